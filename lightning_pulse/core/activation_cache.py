"""Per-sample replay of the outputs of frozen modules, so that a frozen prefix's forward is skipped too.

Plain torch. Used by :class:`~lightning_pulse.GradientCache` with ``activation_cache_mb > 0``; needs the
dataset indices of every batch (:class:`~lightning_pulse.core.sample_index.SampleIndexTracker`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_pulse.core.forward_writes import (
    StateBeforeForward,
    tensor_dicts,
    versions,
    writes_state_reason,
)
from lightning_pulse.core.freeze_metrics import METRIC_PREFIX
from lightning_pulse.core.func_transforms import transform_active
from lightning_pulse.core.prune_targets import has_own_forward
from lightning_pulse.core.sample_index import KEEP_ONE_ROW_PER_INDEX
from lightning_pulse.errors import PulseRefusal

if TYPE_CHECKING:
    from lightning_pulse.core.sample_index import SampleIndexTracker


def check_cache_mb(activation_cache_mb: float) -> float:
    """``activation_cache_mb`` as a float.

    Raises:
        ValueError: naming ``activation_cache_mb``, for anything but a finite number ``>= 0`` (0 is off).
    """
    mb = activation_cache_mb
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 <= mb < math.inf:
        raise ValueError(f"`activation_cache_mb`={mb!r} must be a finite number >= 0 (0 is off).")
    return float(mb)


def uncacheable_reason(module: nn.Module) -> str | None:
    """Why the outputs of ``module`` cannot be replayed per sample, or ``None`` if they can.

    Replaying needs the output to be a function of the sample alone: no dropout and no batch-statistics
    normalisation in training mode inside it, and a plain class ``forward`` that can be swapped for the
    replay while the module is frozen. A forward that writes the module's own state (InstanceNorm's running
    statistics, an EMA, a counter) is found when it first runs recorded (:class:`PrefixActivationCache`).
    """
    if "forward" in vars(module):
        return "it already has an instance-level `forward`"
    for name, sub in module.named_modules():
        what = f"its submodule `{name}`" if name else "it"
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0 and sub.training:
            return (
                f"{what} is dropout in training mode; to cache it, set that dropout's p to 0 "
                "(hidden_dropout_prob=0 in a Hugging Face config), or leave it out of `units`"
            )
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training:
            return f"{what} uses batch statistics in training mode"
    return None


@dataclass
class _ActivationEntry:
    name: str
    module: nn.Module
    # the parameter and buffer dicts of the module and its submodules: what its output depends on
    tensor_dicts: list[dict[str, Any]]
    storage: torch.Tensor | None = None  # (capacity, *output shape without batch)
    # the axis of its first input that held the batch's samples when recorded: 0, 1 (time-major), or None
    input_rows_axis: int | None = None
    input_shape: tuple[int, ...] | None = None  # the shape of one sample of its first input, when recorded
    # per recorded sample, two sums of each tensor argument that held the batch's rows (_input_prints):
    # (capacity, 2 * len(print_columns)), NaN where that sample's recording had no such argument
    input_prints: torch.Tensor | None = None
    print_columns: dict[int | str, int] | None = None  # argument (position or keyword) -> its pair of columns
    calls: int = 0
    transform_calls: int = 0  # in the batch under way: its calls inside a torch.func transform (run for real)
    # in the batch under way: the rows of an output that were not the batch's keys (its first dimension)
    unmatched_rows: int | None = None
    # in the batch under way: why its output cannot be recorded or replayed (it then leaves the cache at the
    # batch's end)
    unrecordable: str | None = None


def _first_tensor(args: tuple[Any, ...]) -> torch.Tensor | None:
    return next((arg for arg in args if isinstance(arg, torch.Tensor)), None)


def reads_gradient(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a tensor among ``args`` and ``kwargs`` (or in a tuple or list among them) requires grad."""
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, torch.Tensor) and item.requires_grad:
                return True
    return False


def _tensor_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int | str, torch.Tensor]]:
    """The tensors among ``args`` and ``kwargs``, each with its position or keyword."""
    named = [*enumerate(args), *kwargs.items()]
    return [(key, value) for key, value in named if isinstance(value, torch.Tensor)]


def print_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the per-row sums of an input on ``device``: float64, but float32 on MPS, which has no
    float64 (the tolerance widens to match, :func:`print_tolerance`)."""
    return torch.float32 if device.type == "mps" else torch.float64


def print_tolerance(dtype: torch.dtype, values_per_row: int) -> tuple[float, float]:
    """``(rtol, atol)`` within which two sums of ``dtype`` over ``values_per_row`` values of one input stand
    for the same input (the order of accumulation moved); mixup, noise or a crop move them by orders of
    magnitude more. float32 (MPS) rounds ~1e-7 per addition, so its atol grows with the values summed."""
    if dtype == torch.float64:
        return 1e-6, 1e-6
    return 1e-4, 1e-6 * max(values_per_row, 1)


_PrintWeights = dict[tuple[int, torch.device, torch.dtype], torch.Tensor]


def _row_print(tensor: torch.Tensor, axis: int, weights_seen: _PrintWeights) -> torch.Tensor:
    """``(rows, 2)`` sums (in :func:`print_dtype`): per row of ``tensor`` (on ``axis``), the sum of its values
    and their sum weighted by fixed pseudo-random weights in [0.5, 1.5) (so a flip or shift within the row
    changes it too), kept in ``weights_seen`` per row length, device and dtype. One product with a
    ``(values per row, 2)`` matrix: the same input gives the same sums up to the order of accumulation,
    whatever the batch."""
    rows = tensor.movedim(axis, 0) if axis else tensor
    flat = rows.reshape(rows.shape[0], -1)  # a view, unless time-major
    dtype = print_dtype(tensor.device)
    key = (flat.shape[1], tensor.device, dtype)
    if (weights := weights_seen.get(key)) is None:
        generator = torch.Generator().manual_seed(0)
        pseudo_random = torch.rand(flat.shape[1], generator=generator, dtype=torch.float64) + 0.5
        weights = torch.stack((torch.ones_like(pseudo_random), pseudo_random), 1).to(tensor.device, dtype)
        weights_seen[key] = weights
    return flat.to(dtype) @ weights


def _input_prints(
    entry: _ActivationEntry, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int
) -> dict[int | str, tuple[torch.Tensor, int]]:
    """The tensor arguments of ``entry`` (by position or keyword) with the axis that holds the batch's
    ``rows`` samples (the axis of its first input when recorded, else 0). Left out, as not per sample: a
    1-dim one other than the first (a ``(T,)`` position vector whose length happens to be the batch size).
    A shared tensor with a row per sample in some batches only ((1, T) position ids in a batch of one row)
    is compared only for the samples recorded with it, so it matches itself; one broadcast along the batch
    (position ids expanded to (B, T)) has the same sums in every row and is compared as any other."""
    found: dict[int | str, tuple[torch.Tensor, int]] = {}
    for number, (key, tensor) in enumerate(_tensor_arguments(args, kwargs)):
        axis = next(
            (
                a
                for a in (entry.input_rows_axis, 0)
                if a is not None and tensor.dim() > a and tensor.shape[a] == rows
            ),
            None,
        )
        if axis is not None and not tensor.is_complex() and (number == 0 or tensor.dim() > 1):
            found[key] = (tensor, axis)
    return found


def _rows_axis(args: tuple[Any, ...], rows: int) -> int | None:
    """The axis of the first tensor among ``args`` that holds the ``rows`` samples: 0 (``(B, ...)``), 1
    (time-major, ``(T, B, ...)``), or ``None`` (neither)."""
    first = _first_tensor(args)
    if first is None:
        return None
    return next((axis for axis in (0, 1) if first.dim() > axis and first.shape[axis] == rows), None)


def _per_sample_shape(args: tuple[Any, ...], rows_axis: int | None) -> tuple[int, ...] | None:
    """The shape of one sample of the first tensor among ``args``: its shape without ``rows_axis`` (without
    its first dimension when that is ``None``); ``None`` without a tensor."""
    first = _first_tensor(args)
    if first is None:
        return None
    shape, axis = tuple(first.shape), rows_axis or 0
    return shape[:axis] + shape[axis + 1 :]


def _input_rows(entry: _ActivationEntry, args: tuple[Any, ...]) -> int | None:
    """How many samples the first tensor among ``args`` holds on the axis that held ``entry``'s samples when
    recorded (``None``: not known)."""
    first, axis = _first_tensor(args), entry.input_rows_axis
    return None if first is None or axis is None or first.dim() <= axis else int(first.shape[axis])


# a batch whose rows are not its keys is never recorded; once most are (at least this many), the cache is off
UNMATCHED_BATCHES_TO_SWITCH_OFF = 8

# Hugging Face speech models make their feature encoder's output require grad in training (for its gradient
# checkpointing); also named by GradientCache's note on a backward that still runs through frozen units
FEATURE_ENCODER_HINT = (
    "wav2vec2's feature encoder sets it on its own output until the model's `freeze_feature_encoder()` is "
    "called, which also saves the backward through it"
)

# a lookup carries no gradient and saves nothing for backward, so it stands for a real forward only where that
# reads and returns no tensor that requires grad: autograd saves tensors only for an op with an input that
# requires grad (a frozen parameter does not), and then sees the same graph either way. Where it differs, the
# recompute of an activation checkpoint around the module (which runs the real forward in backward) saves
# tensors the replayed forward did not, and torch raises a CheckpointError mid-run; elsewhere the gradient
# into the module's input would be lost.
NEEDS_GRADIENT = (
    "its output requires grad or it reads a tensor that does (transformers 5's gradient checkpointing, and "
    "PEFT on 4.x, makes the input embeddings' output require grad; so does an input-gradient penalty, and "
    f"{FEATURE_ENCODER_HINT}), and a replayed output carries no gradient: an "
    "activation checkpoint around it would recompute it for real in backward and fail, and a gradient into its "
    "input would be lost"
)


_Weights = tuple[list[torch.Tensor], list[int]]


def _weights_of(entries: Sequence[_ActivationEntry]) -> _Weights:
    """Every parameter and buffer of the modules of ``entries``, and its version counter, which each in-place
    write bumps. A tensor made under ``torch.inference_mode`` (a buffer rebuilt during validation) keeps no
    counter: it is compared by identity alone (-1). One pass over the tensors, under 1 us each."""
    tensors = [t for entry in entries for d in entry.tensor_dicts for t in d.values() if t is not None]
    return tensors, versions(tensors)


def _same_weights(now: _Weights, seen: _Weights) -> bool:
    """Whether ``now`` holds the tensors of ``seen``, none added, removed, replaced or written since."""
    if len(now[0]) != len(seen[0]):
        return False
    return all(map(operator.is_, now[0], seen[0])) and now[1] == seen[1]


class PrefixActivationCache:
    """Outputs of frozen modules per training sample, replayed so the frozen prefix's forward is skipped.

    While a prefix is frozen its parameters do not change, so a module's output for a given sample does not
    change either. The first visit of a sample records the outputs of the frozen modules; once every sample
    of a batch is recorded, the modules' ``forward`` returns a lookup for that batch instead, and is restored
    right after. The first all-recorded batch of every plan is computed for real once more and compared with
    the records: a mismatch (data augmentation, noise added in ``training_step``, a collate_fn that reorders
    a batch's samples) switches the cache off.
    Every replay also compares two sums per row of each cached module's input with those noted when it was
    recorded (:func:`_row_print`): an input that differs (a transform started after that check) runs the
    batch for real and switches the cache off. So
    does a module whose input or output changes shape per sample from one batch to the next (a collate
    function that pads to each batch's longest sequence): it runs for real from then on. A lookup never
    stands in for an input of another number of samples than the batch's indices: that module runs for real.
    A batch whose rows are not its indices (7 rows for 8 drawn indices: a collate function that drops
    unreadable samples) is neither recorded nor replayed (:attr:`unmatched_batches` counts them); when most
    batches are such (and at least ``UNMATCHED_BATCHES_TO_SWITCH_OFF``), the cache switches itself off.
    A frozen module that cannot be replayed (its output is a tuple, as from ``nn.GRU``; it runs twice per
    forward; its store does not fit the budget; dropout inside; it reads or returns a tensor that requires
    grad, as inside a Hugging Face layer under gradient checkpointing; on a replayed batch too, where it
    then runs for real; its forward writes its own parameters or buffers, found by their version counters at
    every forward that runs while recording or verifying, and by their values at its first recorded forward)
    leaves the cache with every module after it: :attr:`uncached` names it and says why (the modules found
    uncacheable during the fit; never cleared). A parameter or buffer of a cached module written, added or
    replaced between two forwards drops every record (:attr:`weight_changes` counts it): the samples are
    recorded and verified again.
    A call of a cached module made inside a ``torch.func`` transform (``vmap(grad(functional_call(...)))``
    per-sample gradients, a ``vmap(jacrev(net))`` Jacobian penalty) runs for real and leaves the cache's
    state alone (:attr:`transform_calls` counts them): inside ``vmap`` it sees one sample at a time,
    ``functional_call`` swaps other tensors in for the module's own, and the transform forbids writing the
    tensors it captured; the batch's calls outside the transform are recorded and replayed as usual.

    Args:
        capacity: how many distinct samples this process sees per epoch (rows of each store).
        dataset_size: size of the dataset the sample indices refer to.
        budget_bytes: the most memory all stores together may take; modules whose store would not fit are
            not cached (nor any after them).
    """

    def __init__(self, capacity: int, dataset_size: int, budget_bytes: int) -> None:
        self.capacity = int(capacity)
        self.budget_bytes = int(budget_bytes)
        self.slot_of = torch.full((int(dataset_size),), -1, dtype=torch.long)
        self.filled = torch.zeros(self.capacity, dtype=torch.bool)
        self.next_slot = 0
        self.entries: list[_ActivationEntry] = []
        self.verified = False
        self.disabled_reason: str | None = None
        self.mismatched: str | None = None  # the module whose output differed between two visits of a sample
        # the first frozen module of a plan that cannot be replayed (nor any after it, the cache being a
        # prefix) -> why; modules before it are still cached
        self.uncached: dict[str, str] = {}
        self.hits = 0
        self.batches = 0
        # batches whose rows were not their sample indices: neither recorded nor replayed
        self.unmatched_batches = 0
        # (rows, indices) of the batch under way, if they differ
        self._unmatched: tuple[int, int] | None = None
        # times the cached modules' parameters or buffers changed between two forwards (records dropped)
        self.weight_changes = 0
        # calls of cached modules made inside a torch.func transform: run for real, the cache left alone
        self.transform_calls = 0
        # the cached modules' parameters and buffers with their version counters, since their last forward
        self._weights_seen: _Weights | None = None
        self._written_checked_at_forward = True
        self._stubbed: list[nn.Module] = []
        self._indices: torch.Tensor | Callable[[], torch.Tensor] | None = None
        self._slots: torch.Tensor | None = None
        self._keys: torch.Tensor | None = None  # the dataset indices of the batch under way, once resolved
        self._replayed: list[torch.Tensor] = []  # the lookups returned in the batch under way
        self._print_weights: _PrintWeights = {}  # the weights of the input sums (_row_print), per row length
        self._mode = "off"

    @property
    def bytes_used(self) -> int:
        """The bytes of the stores of the outputs and of the per-sample sums of the inputs."""
        tensors = [t for e in self.entries for t in (e.storage, e.input_prints) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def hit_rate(self) -> float | None:
        """Replayed batches over frozen batches, those after a switch-off included (none of them replayed)."""
        return self.hits / self.batches if self.batches else None

    def plan(self, modules: Sequence[tuple[str, nn.Module]]) -> None:
        """Cache the outputs of ``modules`` (the frozen module units, in forward order).

        Records of modules that left the list are dropped, together with every later one: a released unit
        trains, so everything downstream of it changes.
        """
        keep = 0
        while keep < min(len(self.entries), len(modules)) and self.entries[keep].name == modules[keep][0]:
            keep += 1
        changed = keep != len(self.entries) or keep != len(modules)
        self.entries = self.entries[:keep]
        if keep == 0:
            self.filled.zero_()
        for name, module in modules[keep:]:
            if (reason := uncacheable_reason(module)) is not None:
                self.uncached.setdefault(name, reason)
                break
            self.entries.append(_ActivationEntry(name, module, tensor_dicts(module)))
        if changed:
            self.verified = False
            self._weights_seen = None
            if keep == 0:
                self.slot_of.fill_(-1)
                self.next_slot = 0
            else:
                # new modules start empty, so every sample has to be visited again
                self.filled.zero_()

    def begin_batch(self, indices: torch.Tensor | Callable[[], torch.Tensor]) -> str:
        """Prepare the forward of the batch with dataset ``indices`` (B,): ``"hit"``, ``"record"``,
        ``"verify"`` or ``"off"``.

        ``indices`` may be a function that gives them: it is called when the batch's first cached module
        starts its forward (``"pending"`` until then), so a batch cut in place after this call (by
        HardSampleReplay's batch mode) is keyed by the samples that reach the forward.
        """
        self.end_batch()
        if self.disabled_reason is not None:
            # a frozen batch it no longer replays: the hit rate falls from the switch-off on
            self.batches += 1
            return "off"
        if not self.entries:
            return "off"
        self._drop_records_if_written()
        self._written_checked_at_forward = False
        self.batches += 1
        self._indices, self._mode = indices, "pending"
        for entry in self.entries:
            self._install_gate(entry)
        if isinstance(indices, torch.Tensor):
            self._resolve()
        return self._mode

    def end_batch(self) -> None:
        """Undo what :meth:`begin_batch` installed; after a recording forward, mark its samples as recorded."""
        for module in self._stubbed:
            del module.forward  # back to the class's forward
        self._stubbed = []
        cached = len(self.entries)
        if self._mode in ("record", "verify"):
            reached = [e.unmatched_rows for e in self.entries if e.calls]
            if reached and self._slots is not None and all(rows is not None for rows in reached):
                # no module's output had a row per key: the batch's rows are not its samples, not one module
                self._unmatched = (int(reached[0] or 0), len(self._slots))
        if self._mode in ("hit", "miss"):
            # a module replay left to run for real, as its input required grad: out, with the ones after it
            needs = next((e for e in self.entries if e.unrecordable is not None), None)
            if needs is not None:
                assert needs.unrecordable is not None
                self.uncached.setdefault(needs.name, needs.unrecordable)
                self.entries = self.entries[: self.entries.index(needs)]
        if self._unmatched is not None:
            self._count_unmatched(*self._unmatched)
        elif self._mode in ("record", "verify") and self._slots is not None and self.disabled_reason is None:
            broken = next(
                (e for e in self.entries if e.calls != 1 or e.storage is None or e.unrecordable is not None),
                None,
            )
            if broken is not None:
                # a module called twice (or not at all) per forward cannot be replayed by one lookup
                self.uncached.setdefault(broken.name, _why_unrecorded(broken))
                self.entries = self.entries[: self.entries.index(broken)]
            if self.entries:
                self.filled[self._slots] = True
                if self._mode == "verify":
                    self.verified = True
        if len(self.entries) != cached and self._weights_seen is not None:  # fewer cached, none written
            self._weights_seen = _weights_of(self.entries)
        self._mode = "off"
        self._slots = self._indices = self._unmatched = self._keys = None
        self._replayed = []

    def _drop_records_if_written(self) -> bool:
        """Drop every record if the cached modules' tensors were written, added or replaced since their last
        forward (not by it): a prune event's masks, a rollback, the user's code. Notes them as seen now."""
        weights = _weights_of(self.entries)
        written = self._weights_seen is not None and not _same_weights(weights, self._weights_seen)
        if written:
            self.weight_changes += 1
            self.filled.zero_()
            self.verified = False
        self._weights_seen = weights
        return written

    def _count_unmatched(self, rows: int, keys: int) -> None:
        """A batch of ``rows`` rows for ``keys`` sample indices went by; off once most batches are such."""
        self.unmatched_batches += 1
        count = self.unmatched_batches
        if (
            self.disabled_reason is None
            and count >= UNMATCHED_BATCHES_TO_SWITCH_OFF
            and 2 * count > self.batches
        ):
            self.disabled_reason = (
                f"{count} of {self.batches} frozen batches held another number of rows than the dataset "
                f"indices the sampler drew for them (the last: {rows} rows for {keys} indices), so their "
                "outputs cannot be stored per sample: a collate_fn that drops samples (unreadable ones?) "
                "does this, as does a frozen module whose output is not batch-first (time-major); to use the "
                f"cache, {KEEP_ONE_ROW_PER_INDEX}"
            )

    def _resolve(self) -> None:
        """Key the batch by its samples: replay them if all are recorded (and the plan verified), or record."""
        indices = self._indices() if callable(self._indices) else self._indices
        slots = None if indices is None else self._slots_for(indices)
        if slots is None:
            self._mode = "off"
            return
        self._slots, self._keys = slots, indices
        complete = bool(self.filled[slots].all()) and all(e.storage is not None for e in self.entries)
        if complete and self.verified:
            self.hits += 1
            self._mode = "hit"
            for entry in self.entries:
                entry.unrecordable = None
        else:
            self._mode = "verify" if complete else "record"
            for entry in self.entries:
                entry.calls, entry.unmatched_rows, entry.unrecordable = 0, None, None
                entry.transform_calls = 0

    def _slots_for(self, indices: torch.Tensor) -> torch.Tensor | None:
        indices = indices.to(torch.long).cpu()
        slots = self.slot_of[indices]
        new = indices[slots < 0].unique()
        if self.next_slot + len(new) > self.capacity:
            return None
        self.slot_of[new] = torch.arange(self.next_slot, self.next_slot + len(new))
        self.next_slot += len(new)
        return self.slot_of[indices]

    def _record(
        self, entry: _ActivationEntry, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        entry.calls += 1
        slots = self._slots
        if not isinstance(output, torch.Tensor) or slots is None or output.dim() == 0:
            self._unrecordable(entry, _output_reason(output))
            return
        if output.shape[0] != len(slots):
            # not replayable, unless no module of this batch had a row per key: then it is the batch
            # (end_batch tells), which is not recorded
            self._unrecordable(
                entry,
                f"its output has {output.shape[0]} rows for the batch's {len(slots)} samples "
                "(not batch-first?)",
            )
            entry.unmatched_rows = int(output.shape[0])
            return
        if output.requires_grad or reads_gradient(args, kwargs):
            self._unrecordable(entry, NEEDS_GRADIENT)
            return
        if entry.storage is None:
            # the axis of the first positional tensor, else of the first keyword one (``x=`` time-major)
            entry.input_rows_axis = _rows_axis((*args, *kwargs.values()), len(slots))
            found = _input_prints(entry, args, kwargs, len(slots))
            prints_dtype = print_dtype(output.device)
            prints_need = 2 * len(found) * prints_dtype.itemsize * self.capacity
            need = output[0].numel() * output.element_size() * self.capacity + prints_need
            if self.bytes_used + need > self.budget_bytes:
                left = (self.budget_bytes - self.bytes_used) / 2**20
                self._unrecordable(
                    entry,
                    f"its outputs (and input sums) for {self.capacity} samples take {need / 2**20:.3g} "
                    f"MiB, and {left:.3g} MiB of activation_cache_mb={self.budget_bytes / 2**20:g} is left; "
                    "raise activation_cache_mb to cache it",
                )
                return
            entry.storage = torch.zeros(
                (self.capacity, *output.shape[1:]), dtype=output.dtype, device=output.device
            )
            entry.input_shape = _per_sample_shape(args, entry.input_rows_axis)
            entry.print_columns = {}
            entry.input_prints = torch.zeros((self.capacity, 0), dtype=prints_dtype, device=output.device)
        else:
            input_shape = _per_sample_shape(args, entry.input_rows_axis)
            if output.shape[1:] != entry.storage.shape[1:] or input_shape != entry.input_shape:
                self._switch_off_for_shape(entry, input_shape, output)
                return
        stored = entry.storage.index_select(0, slots.to(entry.storage.device))
        if self._mode == "verify" and not torch.allclose(stored, output.detach(), rtol=1e-3, atol=1e-5):
            if self.disabled_reason is None:  # the first module that differs: those after it read its output
                self.mismatched = entry.name
                self.disabled_reason = self._mismatch_reason(entry, stored, output.detach())
            return
        entry.storage.index_copy_(0, slots.to(entry.storage.device), output.detach())
        self._record_prints(entry, args, kwargs, slots)

    def _mismatch_reason(self, entry: _ActivationEntry, stored: torch.Tensor, live: torch.Tensor) -> str:
        """Why the cache switches off when ``entry``'s records of the batch's samples (``stored``) differ from
        their output now (``live``), a row per sample each: what was seen (the module, one sample) and the
        causes that give it, none asserted (a collate_fn sorting each batch by length records every sample
        under another's index, and has nothing to do with augmentation)."""
        close = torch.isclose(stored, live, rtol=1e-3, atol=1e-5).reshape(len(live), -1).all(1)
        differing = (~close).nonzero().flatten().tolist()
        keys = self._keys
        first = f"dataset index {int(keys[differing[0]])}" if keys is not None and differing else "one sample"
        more = f", and {len(differing) - 1} more of the batch's {len(live)}" if len(differing) > 1 else ""
        return (
            f"the output of {entry.name} differs between two visits of the same frozen sample "
            f"({first}{more}): its records are not what its forward gives now. Data augmentation or noise "
            "in the forward does this, as does state that every forward updates, or a collate_fn that "
            "reorders a batch's samples (sorting by length), so that its rows are not in the order the "
            "sampler drew their indices"
        )

    def _record_prints(
        self, entry: _ActivationEntry, args: tuple[Any, ...], kwargs: dict[str, Any], slots: torch.Tensor
    ) -> None:
        """Note, per sample, the sums of ``entry``'s input that a replay compares with its live input."""
        assert entry.input_prints is not None and entry.print_columns is not None
        found, columns = _input_prints(entry, args, kwargs, len(slots)), entry.print_columns
        for key in found.keys() - columns.keys():  # an argument first seen now (a mask the batch needs)
            columns[key] = len(columns)
            prints = entry.input_prints
            nan = prints.new_full((len(prints), 2), math.nan)
            entry.input_prints = torch.cat((prints, nan), 1)
        prints, at = entry.input_prints, slots.to(entry.input_prints.device)
        for key, column in columns.items():
            if key in found:
                pair: torch.Tensor | float = _row_print(*found[key], self._print_weights).to(prints)
            else:
                pair = math.nan  # this recording had no such argument: nothing to compare it with
            prints[at, 2 * column : 2 * column + 2] = pair

    def _input_changed(self, entry: _ActivationEntry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the live input of ``entry`` differs from the one its records of the batch were made of
        (one pair of sums per row of each tensor argument, compared with those noted when recording; an
        argument that is a lookup just replayed is its record); if so, the cache switches off."""
        prints, slots, columns = entry.input_prints, self._slots, entry.print_columns
        assert prints is not None and slots is not None and columns is not None
        found = _input_prints(entry, args, kwargs, len(slots))
        recorded = prints.index_select(0, slots.to(prints.device))
        changed = False
        for key, item in found.items():
            if changed or key not in columns or any(item[0] is replayed for replayed in self._replayed):
                continue
            live = _row_print(*item, self._print_weights)
            rtol, atol = print_tolerance(live.dtype, item[0].numel() // max(len(slots), 1))
            live = live.to(prints)
            pair = recorded[:, 2 * columns[key] : 2 * columns[key] + 2]
            # NaN: the sample was recorded in a batch without this argument (no mask: no padding there)
            live = torch.where(pair.isnan(), 0.0, live)
            pair = pair.nan_to_num(0.0)
            # equal bit for bit most of the time: the tolerance is for an accumulation order that moved
            changed = not (torch.equal(live, pair) or torch.allclose(live, pair, rtol=rtol, atol=atol))
        if changed:
            self._switch_off_for_input(entry)
        return changed

    def _switch_off_for_input(self, entry: _ActivationEntry) -> None:
        """Off for good: ``entry``'s input differs from the one recorded for the same samples."""
        if self.disabled_reason is None:
            self.disabled_reason = (
                f"the input of {entry.name} differs from the one its outputs were recorded for, for the same "
                "samples (data augmentation, mixup or noise that `training_step` started applying after the "
                "cache's first check?); that batch ran for real"
            )

    @staticmethod
    def _unrecordable(entry: _ActivationEntry, reason: str) -> None:
        """``entry`` cannot be replayed: it leaves the cache at the batch's end (with the ones after it)."""
        entry.calls += 1
        if entry.unrecordable is None:
            entry.unrecordable = reason

    def _switch_off_for_shape(
        self, entry: _ActivationEntry, input_shape: tuple[int, ...] | None, output: Any
    ) -> None:
        """Off for good: one sample of ``entry``'s input (``input_shape``) or ``output`` differs from the
        records."""
        assert entry.storage is not None
        recorded = tuple(entry.storage.shape[1:])
        now = tuple(output.shape[1:]) if isinstance(output, torch.Tensor) else None
        # the one that changed, so the message never names two equal shapes
        side, before, after = (
            ("output", recorded, now) if now != recorded else ("input", entry.input_shape, input_shape)
        )
        self.disabled_reason = (
            f"the per-sample {side} of {entry.name} changes shape between batches ({before}, then {after}: a "
            "collate function padding each batch to its longest sequence?); pad to one fixed length to use "
            "the cache"
        )

    def _fits(self, entry: _ActivationEntry, args: tuple[Any, ...]) -> bool:
        """Whether ``entry``'s records of the batch stand for its live input ``args``."""
        if _per_sample_shape(args, entry.input_rows_axis) != entry.input_shape:
            return False
        # a batch cut after it was keyed: the lookup's rows would be other samples (a crash, or wrong rows)
        assert self._slots is not None
        rows = _input_rows(entry, args)
        return rows is None or rows == len(self._slots)

    def _forward_watching_writes(
        self, entry: _ActivationEntry, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``entry``'s forward, run for real; if it wrote the module's own parameters or buffers, the module
        cannot be replayed (a replay would leave them where the real forward moves them): it leaves the
        cache at the batch's end, with the ones after it. Their values are compared at its first recorded
        forward only (one copy of its buffers), their version counters at each."""
        module = entry.module
        before = StateBeforeForward(entry.tensor_dicts, with_values=entry.storage is None)
        output = type(module).forward(module, *args, **kwargs)
        if written := before.written(module, entry.tensor_dicts):
            self._unrecordable(entry, writes_state_reason(module, written))
        return output

    def _install_gate(self, entry: _ActivationEntry) -> None:
        """Swap ``entry``'s forward, for this batch, for one that replays, records or just runs it."""
        module = entry.module

        def gate(*args: Any, **kwargs: Any) -> Any:
            if transform_active():  # inside vmap/grad/jacrev: not a call of the batch's samples
                self.transform_calls += 1
                entry.transform_calls += 1
                return type(module).forward(module, *args, **kwargs)
            if not self._written_checked_at_forward:  # a write after begin_batch (a later callback's hook)
                self._written_checked_at_forward = True
                if self._drop_records_if_written() and self._mode in ("hit", "record", "verify"):
                    self.hits -= self._mode == "hit"
                    self._mode = "pending"  # keyed again: recorded
            if self._mode == "pending":  # the batch's first cached forward: its samples are known now
                self._resolve()
            if self._mode == "hit":
                storage = entry.storage
                assert storage is not None and self._slots is not None
                # one attribute read per tensor argument: a batch whose input requires grad (an input-gradient
                # penalty every k batches) needs the real forward, recorded on batches whose input did not
                if reads_gradient(args, kwargs):
                    entry.unrecordable = NEEDS_GRADIENT
                elif self._fits(entry, args) and not self._input_changed(entry, args, kwargs):
                    replayed = storage.index_select(0, self._slots.to(storage.device))
                    self._replayed.append(replayed)
                    return replayed
                self.hits -= 1  # a miss: this batch's modules run for real from here on
                self._mode = "miss"
                rows = _input_rows(entry, args)  # on the axis that held the samples (1 when time-major)
                if rows is not None and rows != len(self._slots):
                    self._unmatched = (rows, len(self._slots))  # rows that are not its keys: skipped, counted
                output = self._forward_watching_writes(entry, args, kwargs)
                input_shape = _per_sample_shape(args, entry.input_rows_axis)
                if input_shape != entry.input_shape and self.disabled_reason is None:
                    # samples seen before, padded differently: the records no longer fit, so stop caching
                    self._switch_off_for_shape(entry, input_shape, output)
            elif self._mode in ("record", "verify", "miss"):
                output = self._forward_watching_writes(entry, args, kwargs)
                if self._mode != "miss" and entry.unrecordable is None:
                    self._record(entry, args, kwargs, output)
            else:
                output = type(module).forward(module, *args, **kwargs)
            if entry is self.entries[-1]:  # their own writes (old spectral_norm's pre-hook): not a change
                self._weights_seen = _weights_of(self.entries)
            return output

        module.forward = gate  # type: ignore[method-assign]
        self._stubbed.append(module)


def _untracked_refusal(reason: str) -> PulseRefusal:
    """The refusal at fit start of a cache whose training data's sample indices cannot be tracked."""
    return PulseRefusal(
        f"GradientCache: `activation_cache_mb` needs the dataset index of every training sample, and "
        f"{reason}. Set activation_cache_mb=0 (freezing still skips the frozen layers' backward), or train "
        "on one map-style DataLoader with automatic batching and a plain BatchSampler."
    )


def observing_fake_quants(modules: Mapping[str, nn.Module]) -> list[str]:
    """The names of the fake-quant modules (quantization-aware training, ``torch.ao`` eager or FX) whose
    observer is on: they move their scale and zero point at every training forward, which changes what the
    modules after them compute although no parameter moved."""
    from torch.ao.quantization import FakeQuantizeBase

    return [
        name
        for name, module in modules.items()
        if isinstance(module, FakeQuantizeBase)
        and bool(getattr(module, "observer_enabled", torch.ones(1))[0])
    ]


def observer_mismatch_reason(module_name: str, observers: Sequence[str]) -> str:
    """Why the cache switched off when ``module_name``'s output changed between visits of a sample while
    fake-quant ``observers`` (:func:`observing_fake_quants`) were on."""
    shown = ", ".join(observers[:3]) + (f" and {len(observers) - 3} more" if len(observers) > 3 else "")
    return (
        f"the output of {module_name} differs between two visits of the same frozen sample, and the model's "
        f"fake-quant observers update their scale at every training forward ({shown}): state written in "
        "forward, not the frozen parameters, changed it. To use the cache, turn the observers off once they "
        "settled (`model.apply(torch.ao.quantization.disable_observer)`)"
    )


def _output_reason(output: Any) -> str:
    """Why ``output``, not a tensor with a row per sample, cannot be recorded."""
    if isinstance(output, tuple):
        return (
            "its output is a tuple, not one tensor (as from GRU, LSTM or MultiheadAttention), and only a "
            "single tensor output is replayed; to cache it, wrap it in a module returning the one tensor "
            "the model reads and name that module in `units`, or name its enclosing layer (e.g. "
            "`encoder.layers.0`) in `units`"
        )
    if isinstance(output, torch.Tensor):
        return "its output is a 0-dim tensor, with no row per sample"
    return f"its output is a {type(output).__name__}, not one tensor"


def _why_unrecorded(entry: _ActivationEntry) -> str:
    """Why the forward just recorded left ``entry`` without a record it could replay."""
    if entry.unrecordable is not None:
        return entry.unrecordable
    if entry.calls == 0 and entry.transform_calls:
        return (
            "its forward ran only inside a torch.func transform (vmap, grad, jacrev) in a frozen batch, and such "
            "a call runs for real: inside vmap it sees one sample at a time, and functional_call may swap "
            "other tensors in for the module's own"
        )
    if entry.calls == 0 and _no_forward_of_its_own(entry.module):
        return _container_reason(entry)
    if entry.calls == 0:
        return (
            "its forward did not run in a frozen batch (its weights read directly, or the module skipped on "
            "some batches)"
        )
    return "it runs more than once per forward, and one record per sample cannot stand for several calls"


def _no_forward_of_its_own(module: nn.Module) -> bool:
    """Whether ``module`` is a container the model calls the parts of, never itself: its class, like
    ``nn.ModuleList``, ``nn.ModuleDict`` or a ``LightningModule`` reused as a part, defines no ``forward``
    (``has_own_forward``), and it holds parts that do (:func:`_called_parts`). Not one whose parameters are
    all read directly (an ``nn.ParameterList``, a codebook, a ``ModuleDict`` of parameter lists): naming
    its parts would reach nothing the cache can replay."""
    return not has_own_forward(module) and bool(_called_parts("", module))


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _called_parts(name: str, module: nn.Module) -> list[str]:
    """The parts under container ``module`` (named ``name``) that hold parameters and have a forward: its
    children, and for a child with no forward of its own, that child's parts."""
    parts = []
    for child_name, child in module.named_children():
        if not _holds_parameters(child):
            continue
        full = f"{name}.{child_name}"
        # a child with no forward is called through its parts, or only read (an nn.ParameterList: none)
        parts.extend([full] if has_own_forward(child) else _called_parts(full, child))
    return parts


def _read_directly(name: str, module: nn.Module, parts: Sequence[str]) -> list[str]:
    """The parameters under container ``module`` (named ``name``) that none of its ``parts`` holds: the model
    reads them directly, so naming the parts leaves them to the unit ``<rest>``."""
    names = (f"{name}.{param_name}" for param_name, _ in module.named_parameters())
    return [full for full in names if not any(full.startswith(f"{part}.") for part in parts)]


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(f"`{name}`" for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _class_name(module: nn.Module) -> str:
    cls = type(module)
    return f"nn.{cls.__name__}" if cls.__module__.startswith("torch.nn") else cls.__name__


def _container_reason(entry: _ActivationEntry) -> str:
    """Why a unit with no forward of its own (the automatic split makes them: PoolFormer's
    ``encoder.block.0``, ConvNeXtV2's ``downsampling_layer``) cannot be cached, with the children to name in
    ``units`` instead: the cache replays a module's forward, and the parent calls the container's children
    one by one."""
    parts = _called_parts(entry.name, entry.module)
    way_out = f"; to cache them, name its parts in `units` ({_listed(parts)})"
    if read := _read_directly(entry.name, entry.module, parts):
        # left unnamed, they join `<rest>`, which pools every parameter no entry names, wherever it sits
        what = "are read directly: name them too, or they join"
        if len(read) == 1:
            what = "is read directly: name it too, or it joins"
        way_out += f"; {_listed(read)} {what} `<rest>` (not cached either way)"
    return (
        f"it is a container (`{_class_name(entry.module)}`) with no forward of its own: its parent loops "
        f"over it and calls its children, so there is no call of it whose inputs can be cached{way_out}"
    )


class LoaderActivationCache:
    """A :class:`PrefixActivationCache` fed with the dataset indices of a training DataLoader's batches.

    :meth:`attach` installs a :class:`~lightning_pulse.core.sample_index.SampleIndexTracker` into the loader
    (which must not have started a pass yet); :meth:`detach` takes it out again.

    Args:
        tracker: the installed tracker.
        budget_bytes: the most memory the stores may take.

    Attributes:
        trained: gives the dataset indices ``(k,)`` of the samples the step under way trains, where a batch is
            cut in place after it is loaded (``None``: the batch as loaded; a ``None`` it gives: the same).
    """

    def __init__(self, tracker: SampleIndexTracker, budget_bytes: int, model: nn.Module) -> None:
        self.tracker = tracker
        size = tracker.dataset_size
        self.cache = PrefixActivationCache(size, size, budget_bytes)
        self.trained: Callable[[], torch.Tensor | None] | None = None
        # says which frozen modules cannot be replayed, once each (``None``: nobody is told)
        self.warn: Callable[[str], None] | None = None
        self._modules = dict(model.named_modules())
        self._reported = False
        self._uncached_reported: set[str] = set()

    @classmethod
    def attach(cls, loader: Any, budget_bytes: int, model: nn.Module) -> LoaderActivationCache | str:
        """The cache for ``loader`` and ``model``, or the reason why the loader's sample indices cannot be
        tracked."""
        from lightning_pulse.core.sample_index import SampleIndexTracker

        reason = SampleIndexTracker.unsupported_reason(loader)
        if reason is not None:
            return reason
        return cls(SampleIndexTracker.install(loader), budget_bytes, model)

    @staticmethod
    def track(loader: Any) -> None:
        """Install the tracker into a training DataLoader as it is prepared, before its first pass: with
        worker processes a pass draws its first batches' indices as it starts, so a tracker installed at train
        start had none for batch 0. Raises :class:`~lightning_pulse.errors.PulseRefusal` for an untrackable
        loader."""
        from lightning_pulse.core.sample_index import SampleIndexTracker

        if (reason := SampleIndexTracker.unsupported_reason(loader)) is not None:
            raise _untracked_refusal(reason)
        SampleIndexTracker.install(loader)  # shared: HardSampleReplay's install finds it (and vice versa)

    @classmethod
    def for_fit(
        cls,
        loader: Any,
        cache_mb: float,
        model: nn.Module,
        warn: Callable[[str], None],
        trained: Callable[[], torch.Tensor | None] | None = None,
    ) -> LoaderActivationCache | None:
        """The cache of a fit with ``activation_cache_mb=cache_mb`` (and :attr:`trained`) on ``loader``
        (``trainer.train_dataloader``, :meth:`track`-ed): ``None`` when that is 0. Raises
        :class:`~lightning_pulse.errors.PulseRefusal` when the loader's sample indices cannot be tracked."""
        from lightning_pulse.core.sample_index import SampleIndexTracker

        if not cache_mb:
            return None
        if (several := SampleIndexTracker.several_loaders_reason(loader)) is not None:
            raise _untracked_refusal(several)
        replay = cls.attach(loader, int(cache_mb * 2**20), model)
        if isinstance(replay, str):
            raise _untracked_refusal(replay)
        replay.trained, replay.warn = trained, warn
        return replay

    @staticmethod
    def refuse_reload(cache_mb: float, reload_every: int) -> None:
        """Raise :class:`~lightning_pulse.errors.PulseRefusal` at setup for a cache of ``cache_mb`` on
        DataLoaders reloaded every ``reload_every`` epochs: the cache keys its entries by sample through the
        fit's first loader, and a reloaded one is not tracked (it crashed at the second epoch)."""
        if cache_mb and reload_every:
            raise PulseRefusal(
                "GradientCache: `activation_cache_mb` needs one training DataLoader for the whole fit, and "
                f"`reload_dataloaders_every_n_epochs`={reload_every} builds a new one; set "
                "activation_cache_mb=0 (freezing still skips the frozen layers' backward), or stop reloading."
            )

    def detach(self, loader: Any) -> None:
        type(self.tracker).uninstall(loader)

    def plan(self, frozen_units: Sequence[str], again: bool = False) -> None:
        """Cache the outputs of the frozen units that are modules; ``again``: drop every record first."""
        if again:
            self.cache.plan([])
        self.cache.plan([(name, self._modules[name]) for name in frozen_units if name in self._modules])
        self._report_uncached()

    def begin_batch(self, batch_idx: int, frozen: bool) -> None:
        """Before the forward of batch ``batch_idx``; ``frozen``: whether a prefix is frozen now."""
        indices = self.tracker.batch_indices(batch_idx)  # asked for every batch, as the tracker requires
        if not frozen:
            return
        trained = self.trained
        if trained is None:
            self.cache.begin_batch(indices)
            return

        def samples() -> torch.Tensor:  # read at the forward: a batch cut in place by then is keyed as cut
            cut = trained()
            return indices if cut is None else cut

        self.cache.begin_batch(samples)

    def end_batch(self) -> str | None:
        """After the forward. Returns, once, why the cache switched itself off if it just did."""
        self.cache.end_batch()
        self._report_uncached()
        reason = self.cache.disabled_reason
        if reason is None or self._reported:
            return None
        self._reported = True
        if self.cache.mismatched is not None and (observers := observing_fake_quants(self._modules)):
            reason = self.cache.disabled_reason = observer_mismatch_reason(self.cache.mismatched, observers)
        return reason

    @staticmethod
    def switch_off_warning(reason: str) -> str:
        """The warning that the cache switched itself off for ``reason`` (from :meth:`end_batch`), to be said
        on the process where it did: under DDP it names the rank, since the other ranks' caches go on."""
        world = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not world or torch.distributed.get_world_size() == 1:
            return f"GradientCache: the activation cache switched itself off: {reason}."
        return (
            f"GradientCache: rank {torch.distributed.get_rank()}'s activation cache switched itself off: "
            f"{reason}. The other ranks' caches go on, but under DDP every step waits for the slowest rank, "
            "so their replays save little from now on; the logged `activation_hit_rate` is the lowest rank's"
        )

    def logged_hit_rate(self, gather: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The metric ``gradient_cache/activation_hit_rate``: :attr:`PrefixActivationCache.hit_rate` of the
        process with the lowest one (none before a frozen batch). ``gather`` stacks every
        process's tensor in a ``(world_size, ...)`` tensor (one all-gather of two counts; one process: its
        own). Under DDP every step waits for the slowest rank, so a step's frozen forward is saved only where
        every rank replays it: rank 0's rate alone overstated the saving when another rank's cache switched
        itself off (0.42 logged while rank 1 replayed nothing). The lowest rank's rate is still an upper
        bound: the ranks may replay on different steps."""
        counts = gather(torch.tensor([self.cache.hits, self.cache.batches], dtype=torch.long))
        rates = [hits / batches for hits, batches in counts.reshape(-1, 2).tolist() if batches]
        return {f"{METRIC_PREFIX}activation_hit_rate": min(rates)} if rates else {}

    def _report_uncached(self) -> None:
        """Warn, once per module, about a frozen module the cache just left out, and why."""
        new = [name for name in self.cache.uncached if name not in self._uncached_reported]
        for name in new:
            self._uncached_reported.add(name)
            before = ", ".join(f"`{entry.name}`" for entry in self.cache.entries)
            kept = f"the ones before it ({before}) stay cached" if before else "the cache holds nothing"
            if self.warn is not None:
                self.warn(
                    f"GradientCache: the activation cache cannot replay the frozen module `{name}`: "
                    f"{self.cache.uncached[name]}. It runs for real, as do the frozen modules after it, and "
                    f"{kept} while it is frozen."
                )
