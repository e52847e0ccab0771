"""Per-sample losses taken from the loss computation a module already does.

:class:`LossCapture` is a context manager. While it is active, every ``torch.nn.functional`` loss called
from the same thread (directly, or through a ``torch.nn`` loss module such as ``nn.CrossEntropyLoss``,
which calls the functional form) also yields one loss per sample, with no second forward pass:

* the caller gets exactly what the original call returns, same value and same autograd graph, so
  training is bit-for-bit what it would have been (below :data:`SINGLE_PASS_ELEMENTS`; see below);
* the per-sample losses come from one extra call of the same loss with ``reduction="none"`` under
  ``torch.no_grad()``. That is a loss evaluation on outputs that already exist (for cross-entropy, a
  log-softmax over the logits), not a forward pass of the model. On large inputs (from
  :data:`SINGLE_PASS_ELEMENTS` elements: a language model's logits) the loss is instead evaluated once,
  unreduced, and reduced for the caller as torch reduces it, equal to torch's value up to rounding, so
  capture costs no second pass over the logits and no second copy of them in memory. Only that detached
  unreduced loss (and,
  for cross-entropy / NLL, the targets, class weights and ``ignore_index``) is kept; the split into samples
  is done when :meth:`LossCapture.per_sample` (or :func:`concat_per_sample`, for several steps at once) is
  first asked.

When :attr:`LossCapture.sample_weights` is set (InfoBatch's ``1/(1-r)`` rescale), the loss is instead
computed once unreduced and each sample weighted: a reduced loss (``"mean"``, ``"sum"``, ``"batchmean"``) is
weighted, then reduced as torch's own reduction does, so the caller's loss value changes, on purpose (a
``"sum"`` with the weights scaled by ``offered / B``, so that it estimates the offered batch's sum, not its
mean); an unreduced one (``reduction="none"``) is returned unweighted, and the weights multiply its gradient
instead, so whatever the caller computes from it (a focal loss, a clamp, a logged metric) sees the true
per-sample losses and a per-sample sum of it trains on each term weighted.

A per-sample loss is the mean of the sample's elements: for token losses computed on flattened
``(B*T, V)`` logits with ``(B*T,)`` (or ``(B, T)`` flattened) targets, the mean over the sample's ``T``
tokens; ``ignore_index`` tokens are left out and class weights are honoured exactly as the reduced
cross-entropy does, and divided out: one target's sample scores its unweighted loss, also label-smoothed
(:func:`_without_class_weights`). Several calls add up, each with its coefficient in the loss
(:meth:`LossCapture._parts`). For ``kl_div(..., reduction="batchmean")``, which divides the sum by the
input's first dimension, it is the sample's share of that quotient (times ``B``): its sum on ``(B, ...)``
inputs, its sum over ``T`` on flattened ``(B*T, V)`` ones (the mean over its tokens of each token's sum).
For a call the caller reduces itself (``reduction="none"``), once a backward ran, the elements its gradient
leaves out are left out where that gradient is a mask, so a mean over a padding mask
(``(loss * mask).sum() / mask.sum()``) leaves the pads out; any other reduction keeps the plain mean.

For anything capture cannot see (a hand-written loss, a loss imported as a bare function before
capture started, a model that returns its loss), give a :class:`PerSampleScorer`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_leaves

from lightning_pulse.core.carried_state import kept_buffers
from lightning_pulse.errors import PulseRefusal

#: The ``torch.nn.functional`` losses that :class:`LossCapture` sees. ``torch.nn`` loss modules call these.
CAPTURED_LOSSES: tuple[str, ...] = (
    "cross_entropy",
    "nll_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "kl_div",
    "poisson_nll_loss",
    "gaussian_nll_loss",
    "soft_margin_loss",
    "multilabel_soft_margin_loss",
    "multilabel_margin_loss",
    "multi_margin_loss",
    "hinge_embedding_loss",
    "margin_ranking_loss",
    "cosine_embedding_loss",
    "triplet_margin_loss",
    "triplet_margin_with_distance_loss",
    "ctc_loss",
)
# these two divide a "mean" by the summed class weight of the non-ignored targets, not by the element count
_CLASS_WEIGHTED = ("cross_entropy", "nll_loss")
#: From this many elements in a loss's largest input (a language model's ``(B*T, V)`` logits), the loss is
#: evaluated once, unreduced, and reduced for the caller as torch reduces it (equal to torch's value up to
#: rounding): a second evaluation there would cost a pass over the logits and their size in peak memory.
#: Below it, the caller's call runs as written (bit for bit) and the unreduced loss is a second, cheap call.
SINGLE_PASS_ELEMENTS = 1 << 20
_REDUCTIONS = ("mean", "sum", "none", "batchmean")
#: How many autograd nodes of a batch of one sample's 0-d loss are searched for a tensor of the batch (a
#: 48-layer transformer has some 2,600, its token ids at the bottom): bounds the search on a large graph,
#: run once per such call, and only where no argument is itself the batch's (squeezed labels).
BATCH_SEARCH_NODES = 8192


def _sign_order(grad: Tensor, unreduced: Tensor) -> Tensor:
    """``[lowest, highest coefficient, highest loss of an element pushed up, lowest of one pushed down]``
    (float32, on the loss's device) of a call's elements: ``grad`` is ``d loss / d`` each element of
    ``unreduced``. With no element of one sign the last two are ``-inf`` and ``inf``."""
    grad, values = grad.detach().float(), unreduced.detach().float()
    low, high = torch.aminmax(grad)
    # a tolerance for rounding: an analytic positive coefficient never comes out below -1e-6 of the largest
    tolerance = 1e-6 * torch.maximum(-low, high)
    # a NaN coefficient (an overflowed fp16 step) is of no sign
    pushed_up = torch.where(grad < -tolerance, values, -math.inf).max()
    pushed_down = torch.where(grad > tolerance, values, math.inf).min()
    return torch.stack([low, high, pushed_up, pushed_down])


#: why a captured call that no backward reached does not count (:meth:`LossCapture.drop_unused`)
NOT_BACKPROPAGATED = "not part of the loss that is backpropagated (a value computed for logging?)"
#: the same, for a call that ran with autograd off
AUTOGRAD_OFF = (
    "ran with autograd off (in a reentrant activation checkpoint, use_reentrant=True, or a torch.no_grad() "
    "block): not part of the loss that is backpropagated"
)


class CapturedLoss:
    """One loss call seen by a :class:`LossCapture`.

    The per-sample losses are computed when first read, not inside the loss call: a training step only
    keeps the unreduced loss (detached) and, for class-index cross-entropy / NLL, the targets, class weights
    and ``ignore_index`` it needs. A consumer that reads them every few steps does that work in one place.

    Attributes:
        name: the ``torch.nn.functional`` name, e.g. ``"cross_entropy"``.
        reduction: the reduction the caller asked for.
        shape: shape of the unreduced loss.
        maps_onto_batch: whether the unreduced loss splits into the batch's ``B`` samples (its leading size is
            ``B`` or a multiple of it).
        mean_divisor: for a ``"sum"`` call, what torch's ``"mean"`` of it divides by (the sum is that many
            times the mean): its element count, or for class-index cross-entropy / NLL the summed class
            weights of its non-ignored targets (a 0-dim tensor on the loss's device).
        per_sample: ``(B,)`` float32 losses, detached (on the loss's device), or ``None`` when
            ``maps_onto_batch`` is false.
        autograd_off: the call ran with autograd off (in a ``torch.no_grad()`` block, or in the forward of a
            reentrant activation checkpoint), so no backward can reach it.
        samples_along: for a call with ``B`` along both of its first dimensions (or ``B * B`` rows), the
            dimension that holds the samples where its ``target`` is a view of a batch tensor of ``B`` rows
            (``0``; ``1`` for ``y.t()``), told by the view's strides; ``None`` otherwise
            (:mod:`lightning_pulse.core.loss_layout` tells it then).
    """

    __slots__ = (
        "name",
        "reduction",
        "shape",
        "maps_onto_batch",
        "mean_divisor",
        "why_not",
        "on_batch_rows",
        "samples_along",
        "grad",
        "node",
        "unreduced",
        "autograd_off",
        "_source",
        "_per_sample",
    )

    def __init__(
        self,
        name: str,
        reduction: str,
        shape: tuple[int, ...],
        per_sample: Tensor | None = None,
        source: tuple[dict[str, Any], Tensor, int] | None = None,
    ) -> None:
        self.name = name
        self.reduction = reduction
        self.shape = shape
        self._source = source  # (arguments it needs, detached unreduced loss, batch size), until first read
        self._per_sample = per_sample
        self.maps_onto_batch = per_sample is not None if source is None else _splits(shape, source[2])
        self.mean_divisor: float | Tensor = float(math.prod(shape))
        self.why_not = "does not split into the batch's samples"  # read only when maps_onto_batch is false
        self.on_batch_rows = False  # computed on the batch's rows, found not to split (a row check said why)
        # B along both first dimensions: which holds the samples (0, 1), told by a target that views the batch
        self.samples_along: int | None = None
        # d loss / d (what the caller got), summed over the step's backward calls
        self.grad: Tensor | None = None
        self.node: Any = None  # the autograd node of what the caller got, until the step's loss was accounted
        # a call the caller reduces (reduction="none"): its elements, for its part in the loss
        self.unreduced = source[1] if source is not None and reduction == "none" else None
        # the call ran with autograd off (a `torch.no_grad()` block, a reentrant checkpoint's forward)
        self.autograd_off = False

    @property
    def per_sample(self) -> Tensor | None:
        if self._source is not None:
            arguments, unreduced, batch_size = self._source
            self._source = None
            if self.maps_onto_batch:
                self._per_sample = _per_sample_of(
                    self.name, arguments, unreduced, batch_size, self.reduction, self.element_grad(batch_size)
                )
        return self._per_sample

    def element_grad(self, batch_size: int) -> Tensor | None:
        """For a call the caller reduced itself (``reduction="none"``) with several elements per sample: the
        gradient of the loss with respect to each element, once a backward read it; ``None`` otherwise.

        How the caller reduced the elements: a plain mean gives them all the same gradient, a masked mean
        (``(loss * mask).sum() / mask.sum()``) gives the padding none. The sample's score leaves out what such
        a mask leaves out, and only then (:func:`per_sample_from_unreduced`)."""
        grad, unreduced = self.grad, self.unreduced
        if (
            grad is None
            or unreduced is None
            or grad.shape != unreduced.shape
            or unreduced.numel() <= batch_size
        ):
            return None
        return grad

    def __repr__(self) -> str:
        return f"CapturedLoss({self.name!r}, reduction={self.reduction!r}, shape={self.shape})"

    def watch(self, output: Tensor) -> Tensor:
        """Add up, during every backward that reaches it, the gradient of the loss with respect to ``output``
        (what the caller got): its part in the loss that is backpropagated. A hook, not a pass of its own; one
        registered before the caller scales ``output`` in place still sees the value as returned. What a
        ``torch.autograd.grad`` inside ``training_step`` adds is no part of it:
        :meth:`LossCapture.backward_starts` drops it."""
        if output.requires_grad:
            output.register_hook(self._add_grad)
            self.node = output.grad_fn
        else:  # one flag read: why no backward will reach it, for the refusal
            self.autograd_off = not torch.is_grad_enabled()
        return output

    def _add_grad(self, grad: Tensor) -> None:
        grad = grad.detach()
        self.grad = grad if self.grad is None else self.grad + grad


def _splits(shape: tuple[int, ...], batch_size: int) -> bool:
    """Whether an unreduced loss of ``shape`` splits into ``batch_size`` samples (see :func:`rows_per_sample`)."""
    if not shape or batch_size < 1:
        return False
    leading = shape[0]
    return leading >= batch_size and leading % batch_size == 0 and math.prod(shape) > 0


def ambiguous_sample_dimension(shape: tuple[int, ...], batch_size: int) -> bool:
    """Whether an unreduced loss of ``shape`` holds ``B`` along both of its first dimensions, or ``B * B`` rows,
    so that its shape does not tell a batch-first loss from a time-major one whose ``T`` is ``B``."""
    return batch_size >= 2 and bool(shape) and (shape[0] == batch_size**2 or shape[:2] == (batch_size,) * 2)


def _samples_along(target: Any, leaves: list[Tensor], batch_size: int) -> int | None:
    """The dimension of ``target`` (an unreduced loss's, shaped as it) that holds the batch's samples when it is
    a view of a batch tensor of ``B`` rows and at least two dimensions: the one that steps through the tensor's
    rows (``0`` for ``y``, ``1`` for ``y.t()``), or ``0`` for the whole tensor flattened (``y.view(-1)``, sample
    by sample); ``None`` for anything else (a copy, a tensor computed in ``training_step``)."""
    if not isinstance(target, Tensor) or target.dim() == 0 or target.is_sparse:
        return None
    key = _storage_key(target)
    for leaf in leaves:
        if leaf.dim() < 2 or leaf.shape[0] != batch_size or leaf.is_sparse or _storage_key(leaf) != key:
            continue
        if target.dim() == 1:
            flat = leaf.is_contiguous() and target.numel() == leaf.numel() and target.stride(0) == 1
            return 0 if flat and target.data_ptr() == leaf.data_ptr() else None
        along = [
            dim for dim in (0, 1) if target.shape[dim] == batch_size and target.stride(dim) == leaf.stride(0)
        ]
        return along[0] if len(along) == 1 else None
    return None


def _requested_reduction(arguments: dict[str, Any]) -> str:
    # the deprecated size_average / reduce pair still overrides `reduction` in torch
    size_average, reduce = arguments.get("size_average"), arguments.get("reduce")
    if size_average is not None or reduce is not None:
        if reduce is False:
            return "none"
        return "sum" if size_average is False else "mean"
    return str(arguments.get("reduction", "mean"))


def element_weights(name: str, arguments: dict[str, Any], unreduced: Tensor) -> Tensor | None:
    """What each element of ``unreduced`` counts for in a ``"mean"`` reduction (bool or float, shaped like
    ``unreduced``), or ``None`` for "1 each".

    Cross-entropy and NLL with class indices average over the non-ignored targets, weighted by the class
    weight of each target; every other loss averages over all elements.
    """
    if name not in _CLASS_WEIGHTED:
        return None
    target = arguments["target"]
    if target.is_floating_point():  # class probabilities: plain mean, no ignore_index
        return None
    ignore_index = arguments.get("ignore_index", -100)
    valid = target != ignore_index
    weight = arguments.get("weight")
    if weight is None:
        return valid.reshape(unreduced.shape)
    counted = weight[torch.where(valid, target, torch.zeros_like(target))] * valid
    return counted.reshape(unreduced.shape)


def rows_per_sample(unreduced: Tensor, batch_size: int) -> Tensor | None:
    """View an unreduced loss as ``(B, elements_per_sample)``, or ``None`` if it does not split into ``B``.

    ``(B, ...)`` losses split along their first dimension; flattened token losses ``(B*T, ...)`` split
    into ``B`` consecutive blocks of ``T`` (row-major flattening, as ``x.reshape(-1, V)`` does).
    """
    if batch_size < 1 or unreduced.dim() == 0 or unreduced.numel() == 0:
        return None
    leading = unreduced.shape[0]
    if leading != batch_size and (leading % batch_size != 0 or leading < batch_size):
        return None
    return unreduced.reshape(batch_size, -1)


def per_sample_from_unreduced(
    unreduced: Tensor,
    batch_size: int,
    weights: Tensor | None = None,
    reduction: str = "mean",
    grad: Tensor | None = None,
    batchmean_rows: int | None = None,
) -> Tensor | None:
    """``(B,)`` per-sample losses from an unreduced loss (see the module docstring for the rule).

    Args:
        unreduced: the loss with ``reduction="none"``.
        batch_size: ``B``.
        weights: per-element weights from :func:`element_weights` (``None``: every element counts 1).
        reduction: the caller's reduction; ``"batchmean"`` makes a sample's loss its share of the sum that
            ``batchmean`` divides by ``batchmean_rows``: its sum times ``B / batchmean_rows``.
        grad: for a loss the caller reduced itself, the gradient of its loss with respect to each element
            of ``unreduced`` (:meth:`CapturedLoss.element_grad`). Used only where it is a mask (see
            :func:`_kept_by_gradient`): the padding a masked mean leaves out is then left out here too, and a
            sample none of whose elements reach the loss scores 0. Otherwise (a non-linear reduction, a
            threshold on the loss, a gradient that tells nothing) the plain mean.
        batchmean_rows: for ``"batchmean"``, the first dimension of the loss's input, what torch divides the
            sum by (``B*T`` for flattened ``(B*T, V)`` token logits); ``None``: ``unreduced``'s first
            dimension.

    Returns:
        float32 ``(B,)``, detached; ``0`` for a sample with no counted element (all tokens ignored: it adds
        nothing to the loss, and is the easiest to replay), or ``None`` if the loss does not split into ``B``
        samples.
    """
    rows = rows_per_sample(unreduced.detach(), batch_size)
    if rows is None:
        return None
    rows = rows.float()
    if reduction == "batchmean":
        sums = rows[:, 0] if rows.shape[1] == 1 else rows.sum(dim=1)
        divisor = unreduced.shape[0] if batchmean_rows is None else batchmean_rows
        return _batchmean_share(sums, batch_size, divisor)
    if rows.shape[1] == 1:  # one element per sample (classification): no sums needed
        values = rows[:, 0]
        if weights is None:
            return values
        if weights.dtype == torch.bool:
            return values.masked_fill(~weights.reshape(-1), 0.0)
        weights = weights.reshape(-1)  # class-weighted: the sample's own loss; 0 where ignored
        return torch.where(weights != 0, values / weights, 0.0)
    if grad is not None:
        kept, is_mask = _kept_by_gradient(grad.detach().reshape(batch_size, -1).to(rows.device), rows)
        counted = kept if weights is None else kept * weights.detach().reshape(batch_size, -1)
        counts = counted.sum(dim=1, dtype=torch.float32)
        masked = torch.where(counts != 0, (rows * kept).sum(dim=1) / counts, 0.0)
        plain = per_sample_from_unreduced(unreduced, batch_size, weights, reduction)
        return torch.where(is_mask, masked, plain)  # type: ignore[arg-type]
    if weights is None:
        return rows.mean(dim=1)
    counts = weights.detach().reshape(batch_size, -1).sum(dim=1, dtype=torch.float32)
    return torch.where(counts != 0, rows.sum(dim=1) / counts, 0.0)  # every token ignored: 0


def _batchmean_share(sums: Tensor, batch_size: int, batchmean_rows: int) -> Tensor:
    """Each sample's share of a ``"batchmean"`` loss, times ``B``, from its sum ``(B,)``: torch divides the
    sum by the input's first dimension, not by ``B``. On flattened ``(B*T, V)`` token logits (DistilBERT's and
    most LLM-distillation scripts' KL) that is ``B*T``, and the plain sum, next to a token-mean cross-entropy,
    counted the KL ``T`` times (a held-out sweep: hardness ranked against the loss, rank correlation -0.6 to
    -0.9)."""
    if batchmean_rows == batch_size:
        return sums
    return sums * (batch_size / batchmean_rows)


def _kept_by_gradient(grad: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """``(kept, is_mask)`` for a loss the caller reduced itself, from its element gradient ``grad`` and its
    elements ``rows``, both ``(B, elements)``: ``kept`` (float, 1 where the gradient is not zero), and a 0-dim
    bool saying whether the gradient acts as a mask that the score may follow. On the device, no sync.

    A mask, as a mean over padding (``(loss * mask).sum() / mask.sum()``, also per sample then over the
    batch, also of a non-linear per-element loss), leaves out elements whatever their loss. A threshold on
    the loss does not: ``l[l > 0.7].mean()``, ``relu(l - 0.5).mean()`` or a top-k leave out each sample's
    lowest losses, ``l.clamp(max=2).mean()`` its highest; following it would score a sample by what its
    reduction kept (a sample whose every element is clamped would score 0, the easiest), so it keeps the plain
    mean. A threshold is told from padding by every sample that has both kept and left-out elements leaving
    out only losses no larger than the ones it keeps, or only losses no smaller: padding, independent of the
    loss, does not do that in every sample (when it does, the plain mean is kept, as before). Left-out
    elements whose loss is exactly 0 (pads zero-filled in both the prediction and the target) are no evidence
    either way: they add nothing to any sum. Only where the gradient is kept (0 or not) counts, never its size, so a
    non-linear reduction that keeps every element scores the plain mean."""
    kept = grad != 0
    evidence = ~kept & (rows != 0)  # left out, and with a loss that would have counted
    both = kept.any(dim=1) & evidence.any(dim=1)
    dropped_top = torch.where(evidence, rows, -torch.inf).amax(dim=1)
    dropped_bottom = torch.where(evidence, rows, torch.inf).amin(dim=1)
    kept_bottom = torch.where(kept, rows, torch.inf).amin(dim=1)
    kept_top = torch.where(kept, rows, -torch.inf).amax(dim=1)
    one_sided = (dropped_top <= kept_bottom) | (dropped_bottom >= kept_top)
    threshold = both.any() & (~both | one_sided).all()
    total = grad.abs().float().sum()
    is_mask = torch.isfinite(total) & (total > 0) & ~threshold
    return kept.float(), is_mask


def _without_class_weights(
    name: str, original: Callable[..., Tensor], arguments: dict[str, Any], unreduced: Tensor
) -> Tensor:
    """The unreduced loss to score a class-weighted, label-smoothed cross-entropy by: each element's loss
    without class weights (smoothed as the call smooths) times its target's class weight, so that a sample's
    score, split as the weighted mean is (:func:`per_sample_from_unreduced`), is its unweighted smoothed loss
    (one target per sample) or the class-weighted mean of its tokens' (several). ``unreduced`` otherwise.

    torch weights the smoothing term ``ls / C * sum_c w_c * (-log p_c)`` by every class's weight, not the
    target's: dividing torch's per-sample loss by the target's weight (right without smoothing) inflated it
    for low-weight classes and ranked the samples nearly backwards (rank correlation -0.88 with torch's own
    per-sample loss at ``ls=0.3``). Costs one more evaluation of the loss, without gradient."""
    if name != "cross_entropy" or arguments.get("weight") is None or not arguments.get("label_smoothing"):
        return unreduced
    target = arguments.get("target")
    if not isinstance(target, Tensor) or target.is_floating_point():  # class probabilities: weights stay
        return unreduced
    with torch.no_grad():
        unweighted = original(**{**_LossSignature.unreduced_call(arguments), "weight": None})
        counted = element_weights(name, arguments, unweighted)
        return unweighted * counted.to(unweighted.dtype)


def _per_target_length(arguments: dict[str, Any], unreduced: Tensor) -> Tensor:
    """CTC's ``(B,)`` unreduced loss divided by each sample's target length (at least 1), as its ``"mean"``
    reduction does before averaging over the batch: the sample's share of that mean."""
    lengths = torch.as_tensor(arguments["target_lengths"], device=unreduced.device)
    return unreduced / lengths.clamp_min(1).to(unreduced.dtype)


def _reduce(
    name: str,
    arguments: dict[str, Any],
    unreduced: Tensor,
    reduction: str,
    sample_weights: Tensor | None = None,
) -> Tensor:
    """Reduce ``unreduced`` the way the caller asked (as torch's own reduction does: ``"mean"`` divides by the
    counted elements, the summed class weights of non-ignored targets for cross-entropy / NLL), after
    multiplying each sample's elements by its weight when ``sample_weights`` ``(B,)`` is given.

    ``reduction="none"``: the values unweighted, a tensor of their own (the caller may change it in place; the
    capture keeps ``unreduced`` for the scores); the caller weights their gradient
    (:func:`_weigh_gradient`)."""
    if name == "ctc_loss" and reduction == "mean":
        unreduced = _per_target_length(arguments, unreduced)  # torch averages the length-divided losses
    if reduction == "none":
        return unreduced if sample_weights is None else unreduced.clone()
    values = unreduced
    if sample_weights is not None:
        rows = rows_per_sample(unreduced, sample_weights.shape[0])
        assert rows is not None
        weights = sample_weights.to(device=rows.device, dtype=rows.dtype).unsqueeze(1)
        values = (rows * weights).reshape(unreduced.shape)
    if reduction == "sum":
        return values.sum()
    if reduction == "batchmean":
        return values.sum() / arguments["input"].shape[0]  # kl_div, the only loss with "batchmean"
    counted = element_weights(name, arguments, unreduced)
    if counted is None:
        return values.mean() if sample_weights is None else values.sum() / unreduced.numel()
    return values.sum() / counted.sum(dtype=values.dtype)


def _weigh_gradient(sample_weights: Tensor) -> Callable[[Tensor], Tensor]:
    """A tensor hook multiplying the gradient of an unreduced loss by each sample's weight ``(B,)``, broadcast
    over the sample's elements as :func:`rows_per_sample` splits them.

    How InfoBatch weights a loss the caller reduces itself, maybe not linearly (a focal loss's
    ``(1 - exp(-ce)) ** g * ce``, a clamp, OHEM's top-k, a logged metric): the caller sees the unweighted
    losses, and a loss ``sum_i f(loss_i)`` over them trains on the gradient of ``sum_i w_i * f(loss_i)``, not
    of ``sum_i f(w_i * loss_i)`` (the same for a linear ``f``)."""

    def weigh(grad: Tensor) -> Tensor:
        # a 0-d gradient: of a batch of one sample's 0-d loss (LossCapture._record), its one row
        rows = rows_per_sample(grad.reshape(1) if not grad.dim() else grad, sample_weights.shape[0])
        assert rows is not None  # the loss was checked to split into the weights' samples
        return (rows * sample_weights.to(rows.dtype).unsqueeze(1)).reshape(grad.shape)

    return weigh


class _Interceptor:
    """Process-wide bookkeeping: which threads have an active capture, and the patched functions."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: dict[int, list[LossCapture]] = {}
        self.originals: dict[str, Callable[..., Tensor]] = {}  # filled while patched
        self.wrappers: dict[str, Callable[..., Tensor]] = {}  # built once, on first use
        self.holds = 0  # open loss_capture_scope() blocks: keep the patch in place between captures
        self.local = threading.local()

    def current(self) -> LossCapture | None:
        if getattr(self.local, "busy", False):  # a loss called from inside a handled loss call
            return None
        stack = self.active.get(threading.get_ident())
        return stack[-1] if stack else None

    def hold(self, delta: int) -> None:
        with self.lock:
            self.holds += delta
            if delta > 0:
                self._patch()
            else:
                self._unpatch_if_idle()

    def _patch(self) -> None:
        if not self.originals:
            if not self.wrappers:
                for name in CAPTURED_LOSSES:
                    self.wrappers[name] = self._wrap(name, getattr(F, name))
            for name, wrapper in self.wrappers.items():
                self.originals[name] = getattr(F, name)
                setattr(F, name, wrapper)

    def _unpatch_if_idle(self) -> None:
        if not self.active and self.holds <= 0 and self.originals:
            for name, original in self.originals.items():
                setattr(F, name, original)
            self.originals.clear()

    def push(self, capture: LossCapture) -> None:
        with self.lock:
            if not self.originals:
                self._patch()
            self.active.setdefault(threading.get_ident(), []).append(capture)

    def pop(self, capture: LossCapture) -> None:
        with self.lock:
            stack = self.active.get(threading.get_ident(), [])
            if capture in stack:
                stack.remove(capture)
            if not stack:
                self.active.pop(threading.get_ident(), None)
            self._unpatch_if_idle()

    def _wrap(self, name: str, first_original: Callable[..., Tensor]) -> Callable[..., Tensor]:
        signature = _LossSignature(inspect.signature(first_original))

        @functools.wraps(first_original)
        def captured_loss(*args: Any, **kwargs: Any) -> Tensor:
            # whatever F.<name> was when this patch went in (another library may have wrapped it too)
            original = self.originals.get(name, first_original)
            capture = self.current()
            if capture is None:
                return original(*args, **kwargs)
            if torch.compiler.is_compiling():
                # torch.compile tracing a loss into its graph (dynamo turns nn.CrossEntropyLoss into one): the
                # tensors here are the tracer's, and the compiled graph will not call this again
                capture.compiled_calls.append(name)
                return original(*args, **kwargs)
            self.local.busy = True
            try:
                return capture._handle(name, original, signature, args, kwargs)
            finally:
                self.local.busy = False

        # a compiled module's functional loss call runs this eagerly, at a graph break (traced into the graph,
        # it would record the tracer's tensors once and nothing after: a compiled HF BERT crashed on them)
        return torch.compiler.disable(captured_loss)


class _LossSignature:
    """Argument handling of one loss function, without ``inspect.Signature.bind`` on the hot path."""

    def __init__(self, signature: inspect.Signature) -> None:
        self.signature = signature
        self.names = list(signature.parameters)
        self.defaults = {n: p.default for n, p in signature.parameters.items() if p.default is not p.empty}
        # calls that pass none of these positionally take the fast path
        self.first_reduction_position = min(
            self.names.index(n) for n in ("reduction", "size_average", "reduce") if n in self.names
        )

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Every argument by name (defaults included)."""
        if len(args) <= self.first_reduction_position:
            arguments = dict(self.defaults)
            arguments.update(zip(self.names, args))
            arguments.update(kwargs)
            return arguments
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    @staticmethod
    def unreduced_call(arguments: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments for the same call with ``reduction="none"`` (the losses have no
        positional-only parameters, so everything can be passed by name)."""
        arguments = dict(arguments)
        for legacy in ("size_average", "reduce"):
            if legacy in arguments:
                arguments[legacy] = None
        arguments["reduction"] = "none"
        return arguments


_INTERCEPTOR = _Interceptor()


@contextmanager
def losses_not_captured() -> Iterator[None]:
    """Losses called in this thread inside the block pass straight through, even inside an open capture:
    another callback's forward on a copy of the model (ScheduledPrune's trial cut on the first batch, which
    runs a Hugging Face model's own loss on two rows) is not the step's loss."""
    local = _INTERCEPTOR.local
    was_busy = getattr(local, "busy", False)
    local.busy = True
    try:
        yield
    finally:
        local.busy = was_busy


@contextmanager
def loss_capture_scope() -> Iterator[None]:
    """Keep ``torch.nn.functional``'s losses patched for a whole block (e.g. one ``fit``).

    Without it, each :class:`LossCapture` patches on entry and restores on exit; inside it, entering and
    leaving a capture costs only a list append and pop. Outside an active capture, the patched losses pass
    straight through to the originals.
    """
    _INTERCEPTOR.hold(+1)
    try:
        yield
    finally:
        _INTERCEPTOR.hold(-1)


class LossCapture:
    """Collect per-sample losses from ``torch.nn.functional`` losses called inside the ``with`` block.

    Only calls from the thread that entered the block are captured; other threads see the plain
    functions. Captures nest (the innermost one handles a call). The patch of ``torch.nn.functional``
    exists only while at least one capture is active.

    Args:
        batch_size: ``B``, the number of samples in the batch the block trains on. Needed to map an
            unreduced loss onto samples.
        sample_weights: optional ``(B,)`` weights under which the *mean* over these ``B`` samples
            estimates the mean over the ``offered`` samples they were kept from (InfoBatch:
            ``(1 / q_i) * B / offered``). Each sample's elements are multiplied by its weight before the
            caller's reduction, and the caller gets that weighted loss (with autograd): a ``"mean"`` or
            ``"batchmean"`` then estimates the offered batch's, and a ``"sum"``, weighted by
            ``sample_weights * offered / B`` (``1 / q_i``), its sum. With ``reduction="none"`` the caller
            gets the unweighted losses and the weights multiply their gradient (a non-linear use of them, a
            focal loss, is not changed, and is trained on weighted per sample): right for a caller that
            averages them over the ``B`` samples (``.mean()``); which reduction the caller applies cannot be
            seen, and a plain ``.sum()`` trains on ``B / offered`` of the offered batch's sum.
        offered: how many samples ``sample_weights`` stand for (``n >= B``); ``None``: ``B``.
        batch: the batch the block trains on, for the row counts and storage of its tensors only (not kept):
            a call whose rows do not split into ``B`` samples but that reads a tensor of the batch's ``N``
            rows (a graph batch's nodes, packed sequences' tokens, also a ``(1, N)`` row of them or a view
            such as ``ids[None]``), as its target (or a slice of it: ``ids[1:]``) or as a layer's input, is on
            the batch's rows, and makes the step unsplittable, also with ``N - 1`` rows (a next-token shift);
            without it, such a call is left out as a penalty on the weights is.
        module: the module training, for its own tensors (parameters, buffers, tensor attributes; not kept past
            :meth:`close`): a call of ``B`` rows (or a multiple) that reads none of the batch's tensors and only
            the module's own (an initial condition's points held as a buffer) is left out, as a penalty on the
            weights is (:meth:`_rows_of_the_module`); without it, such a call is split into the samples.

    Attributes:
        maximized: the optimizers ascend the loss the module returns (torch's ``maximize=True``; set by the
            caller, :func:`~lightning_pulse.core.loss_direction.maximizes_loss`): the captured calls' parts in
            it (:meth:`per_sample` of several calls) and their coefficients (:meth:`signed_coefficients`) are
            read negated, as parts of the value they descend. One call's score, its own value, is the same in
            either direction.

    Example::

        capture = LossCapture(batch_size=len(y))
        with capture:
            loss = F.cross_entropy(model(x), y)      # unchanged value and graph
        losses = capture.per_sample()                # (B,) float32, detached
    """

    def __init__(
        self,
        batch_size: int,
        sample_weights: Tensor | None = None,
        offered: int | None = None,
        batch: Any = None,
        module: torch.nn.Module | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size`={batch_size!r} must be a positive int.")
        if sample_weights is not None and tuple(sample_weights.shape) != (batch_size,):
            raise ValueError(
                f"`sample_weights` has shape {tuple(sample_weights.shape)}; expected ({batch_size},)."
            )
        if offered is not None and (
            isinstance(offered, bool) or not isinstance(offered, int) or offered < batch_size
        ):
            raise ValueError(f"`offered`={offered!r} must be an int of at least `batch_size`={batch_size}.")
        self.batch_size = batch_size
        self.sample_weights = sample_weights
        self.offered = batch_size if offered is None else offered
        # a "sum" estimates the offered batch's sum: the mean weights' B / offered factor taken out again
        self._sum_weights = sample_weights
        if sample_weights is not None and self.offered != batch_size:
            self._sum_weights = sample_weights * (self.offered / batch_size)
        # the batch's tensors whose first dimension is not B (packed rows: a graph batch's nodes), by storage:
        # their row counts and where they lie, to know a loss reading them (no reference to the batch is kept)
        leaves = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, Tensor)]
        packed = [leaf for leaf in leaves if leaf.dim() >= 1 and leaf.shape[0] != batch_size]
        self._batch_rows = frozenset(count for leaf in packed for count in _row_counts(leaf))
        self._batch_storages = frozenset(_storage_key(leaf) for leaf in packed)
        self._joined_items = _joined_item_shapes(batch, batch_size)
        # every tensor of the batch, by storage: a batch of one sample's 0-d loss is its loss only where the
        # call read one (views, `labels.squeeze()`, share the storage), and a call of B rows is the module's own
        # only where it read none. Only those ask: not built for the others (on HardSampleReplay's per-step path)
        self._all_batch_storages = (
            frozenset(_storage_key(leaf) for leaf in leaves if leaf.numel())
            if batch_size == 1 or module is not None
            else frozenset()
        )
        # while the capture is open, with a module: the batch's tensors and the module's own (built when a call
        # first needs them), which a call's rows are told by (_rows_of_the_module)
        self._module = module
        self._batch_leaves = [leaf for leaf in leaves if leaf.numel()] if module is not None else []
        self._known: tuple[_NamedTensors, _NamedTensors] | None = None
        # per call site, what its rows were found to read, over a fit (StepLossCaptures shares it): a set of
        # verdicts (the module tensors' names, or None for "the batch's") and, per row count walked, the capture
        # that first walked it
        self.row_sources: dict[tuple[Any, ...], tuple[set[str | None], dict[int, int]]] = {}
        self.serial = 0  # which step's capture this is (StepLossCaptures counts them)
        # call sites whose graph was walked and read no batch tensor of their rows' count: not walked again
        # (a walk that finds nothing walks the whole graph, ms per call);
        # StepLossCaptures shares it over a fit
        self.unread_sites: set[tuple[Any, ...]] = set()
        self.records: list[CapturedLoss] = []
        self.compiled_calls: list[str] = []  # losses traced into a torch.compile graph: not capturable
        # per watched loss (watch_loss): [d backpropagated / d loss, summed over backward calls; divided_by]
        self.watched_losses: list[list[Any]] = []
        self._watched_tensors: list[Any] = []
        self._backward_starts: list[tuple[list[Any], list[Any]]] = []
        self._entered = False
        self._per_sample: Tensor | None = None
        self._per_sample_count = 0  # how many records `_per_sample` was computed from
        self.maximized = False

    def __enter__(self) -> LossCapture:
        if self._entered:
            raise RuntimeError("This LossCapture is already active.")
        self._entered = True
        _INTERCEPTOR.push(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop capturing (idempotent). Same as leaving the ``with`` block."""
        if self._entered:
            _INTERCEPTOR.pop(self)
            self._entered = False
        # neither the module nor the batch is kept with a recorded step
        self._module, self._batch_leaves, self._known = None, [], None

    @property
    def active(self) -> bool:
        return self._entered

    @property
    def maps_onto_batch(self) -> bool:
        """Whether a captured call splits into the batch's samples, and no call computed on the batch's rows
        failed to (cheap: shapes and a few autograd nodes, nothing computed). A call on the batch that does not
        split (``logits[mask]``, concatenated views) makes the whole step unsplittable: a score without that
        term would not be the sample's loss. A call that is not on the batch's rows at all (a penalty on the
        weights) adds the same to every sample and is left out."""
        if any(record.on_batch_rows and not record.maps_onto_batch for record in self.records):
            return False
        return any(record.maps_onto_batch for record in self.records)

    def per_sample(self) -> Tensor | None:
        """The ``(B,)`` per-sample loss: the sum over every captured call that maps onto the batch.

        Summing matches a module whose loss is a sum of terms (e.g. a task loss plus a distillation loss).
        ``None`` if no captured call mapped onto ``B`` samples. Computed once per capture and kept (a later
        captured call recomputes it); do not modify the returned tensor.
        """
        if self._per_sample_count == len(self.records):
            return self._per_sample
        mapped = [record for record in self.records if record.maps_onto_batch]
        parts = self._parts(mapped)
        total = None
        for index, record in enumerate(mapped):
            values = record.per_sample
            if values is None:
                continue
            term = values if parts is None else parts(index, values)
            total = term if total is None else total + term
        self._per_sample, self._per_sample_count = total, len(self.records)
        return total

    def watch_loss(self, loss: Tensor, divided_by: float | Tensor = 1.0) -> None:
        """Watch ``loss``, what a backward of the step backpropagates, for that backward's scale: several
        calls' parts in it are then read as their exact coefficients (:meth:`_parts`).
        ``divided_by``: what the loss the module returned was divided by to become ``loss`` (Lightning divides
        it by ``accumulate_grad_batches`` under automatic optimization, and ``16-mixed`` multiplies it by the
        GradScaler's scale before the hook that calls this: a 0-dim tensor then, read without a sync), so that
        the coefficients are the returned loss's. Call it before the backward; a loss backpropagated again
        (``retain_graph``) is watched once."""
        if not isinstance(loss, Tensor) or not loss.requires_grad or loss.numel() != 1:
            return
        if sum(record.maps_onto_batch for record in self.records) < 2:
            return  # one term (the usual loss) has no coefficient to read: no hook on the step's path
        if any(watched() is loss for watched in self._watched_tensors):
            return  # backpropagated again (retain_graph): its hook already adds every backward's gradient
        self._watched_tensors.append(weakref.ref(loss))
        slot: list[Any] = [None, divided_by if isinstance(divided_by, Tensor) else float(divided_by)]

        def add(grad: Tensor) -> None:
            grad = grad.detach().reshape(())
            slot[0] = grad if slot[0] is None else slot[0] + grad
            # the records' gradients as this backward starts: which backward reached them (no sync)
            self._backward_starts.append((slot, [record.grad for record in self.records]))

        loss.register_hook(add)
        self.watched_losses.append(slot)
        self._per_sample_count = -1

    def _backward_scale(self) -> Tensor | None:
        """``d backpropagated / d returned loss``, a 0-dim tensor on the device, from the watched losses;
        ``None`` when none was watched or reached. Several backward calls (manual optimization) share it
        only if each one's is the same: otherwise it is NaN (nothing is synchronised here), and the parts
        fall back."""
        reached = self._slots_reaching_records()
        scales = [grad.float() / divided_by for grad, divided_by in reached if grad is not None]
        if not scales:
            return None
        first = scales[0]
        for other in scales[1:]:
            first = torch.where(other.to(first.device) == first, first, torch.nan)
        return first

    def backward_starts(self) -> None:
        """The step's own backward is about to run (its first: Lightning's, or the first ``manual_backward``):
        forget the gradients the records' hooks added until now. They came from ``torch.autograd.grad`` calls
        inside ``training_step`` that reached a captured call (FGSM's input gradient of the clean loss, a
        gradient penalty on ``d loss / d x``), which are no part of the loss that trains: counted, the clean
        term's coefficient read 2, not 1, and each sample scored ``2 * clean + adv`` (a held-out sweep). A call
        only such a pass reached (a loss computed for its input gradient alone) is then no part of the loss
        either (:meth:`drop_unused`)."""
        for record in self.records:
            record.grad = None
        self._backward_starts.clear()
        self._per_sample_count = -1

    def _slots_reaching_records(self) -> list[list[Any]]:
        """The watched losses whose backward changed a record's gradient (a GAN's generator backward does
        not reach the discriminator's terms, and may run at another AMP scale); all of them if unknown."""
        if not self._backward_starts:
            return self.watched_losses
        ends = [before for _, before in self._backward_starts[1:]] + [[r.grad for r in self.records]]
        reaching: list[list[Any]] = []
        for (slot, before), after in zip(self._backward_starts, ends):
            changed = any(a is not b for a, b in zip(before, after))
            if changed and not any(slot is other for other in reaching):
                reaching.append(slot)
        return reaching or self.watched_losses

    def coefficients_unknown(self) -> bool:
        """Whether several calls' parts are read relative to the largest one, not as their exact coefficients
        in the returned loss: no watched loss reached by the backward (a manual ``loss.backward()`` that
        bypasses the hook that watches it), or several backward calls of different scales. Synchronises
        only for several backward calls."""
        mapped = [record for record in self.records if record.maps_onto_batch]
        if len(mapped) < 2 or any(record.grad is None for record in mapped):
            return False
        reached = [grad for grad, _ in self._slots_reaching_records() if grad is not None]
        if len(reached) < 2:
            return not reached
        scale = self._backward_scale()
        return scale is None or bool(torch.isnan(scale))

    def signed_coefficients(self) -> str | None:
        """After the step's backward: the captured calls the caller reduced itself (``reduction="none"``)
        whose elements enter the backpropagated loss with coefficients of both signs out of the loss's order
        (a policy gradient's ``(F.cross_entropy(logits, a, reduction="none") * advantage).mean()``),
        described; else ``None``.

        The gradient each call's hook already added up (``d loss / d`` its elements; negative: the step pushes
        that element up) is read, with no hook of its own, in one device sync for all calls, so a caller
        checks a fit's first steps only. Positive coefficients (sample weights, a masked mean, a focal factor)
        weight each sample's own loss. Coefficients of both signs are refused only when some element pushed up
        has a higher loss than some element pushed down: where only the easiest elements are pushed up (a
        per-sample flooding ``|ce - b|``, ``ce.mean() + ce.std()``, a softmax-weighted ``ce``), ranking by
        the unweighted loss still agrees with the loss that trains; where the signs cross that order
        (advantages, a variance penalty across groups, a PU loss), ``loss_i`` ranks no hardness. Where the
        optimizers ascend the loss (:attr:`maximized`) the coefficients read are of ``-loss``, which they
        descend."""
        signed = [
            record
            for record in self.records
            if record.maps_onto_batch
            and record.grad is not None
            and record.unreduced is not None
            and tuple(record.grad.shape) == tuple(record.unreduced.shape)
            and record.grad.numel() > 1
        ]
        if not signed:
            return None
        device = signed[0].grad.device
        # maximized: the step descends -loss, so an element whose coefficient in the loss is negative is
        # pushed down (the twin that returns -loss and descends it reads the same coefficients)
        sign, loss = (-1.0, "d(-loss)") if self.maximized else (1.0, "d loss")
        ranges = torch.stack([_sign_order(sign * r.grad, r.unreduced).to(device) for r in signed]).tolist()
        found = []
        for record, (low, high, hardest_up, easiest_down) in zip(signed, ranges):
            if hardest_up > easiest_down:
                found.append(
                    f"{record.name}(reduction='none') ({loss} / d its elements from {low:.3g} to {high:.3g}; "
                    f"an element it pushes up has a loss of {hardest_up:.3g}, one it pushes down "
                    f"{easiest_down:.3g})"
                )
        return "; ".join(found) or None

    def drop_unused(self) -> None:
        """After the step's backward calls (call it only when one ran): a call that none of them reached (a value
        computed for logging) no longer counts."""
        for record in self.records:
            record.node = None  # the backward ran: nothing is left to account for
            if record.grad is None:
                record.maps_onto_batch, record.on_batch_rows = False, False
                record.why_not = AUTOGRAD_OFF if record.autograd_off else NOT_BACKPROPAGATED
        self._per_sample_count = -1

    def _parts(self, mapped: list[CapturedLoss]) -> Callable[[int, Tensor], Tensor] | None:
        """For several calls that are all part of the loss: ``(i, values) ->`` call ``i``'s per-sample term as
        its part in the loss: its coefficient in the loss the step returned (``lam * ce(out, y) + (1 - lam) *
        ce(out, y[perm])`` scores each sample ``lam * ce_y + (1 - lam) * ce_perm``, whatever ``lam`` is this
        step), where that loss was watched (:meth:`watch_loss`); else relative to the largest part (``ce +
        0.1 * mse`` scores ``ce + 0.1 * mse``, but coefficients that change from step to step are off by a
        factor that changes too). ``None`` (an unweighted sum) for one call, or when a part cannot be read.
        On the device; nothing is synchronised. Where the optimizers ascend the loss (:attr:`maximized`) each
        part is of ``-loss``, the value they descend: a module returning ``-(ce + 0.1 * mse)`` to ascend
        scores ``ce + 0.1 * mse``, as its twin returning ``ce + 0.1 * mse`` to descend does (the parts of
        the returned value itself ranked the easiest samples highest).

        With ``g`` the gradient of the loss with respect to what the caller got, each call stands for its
        per-sample losses (as scored alone) times its weight in the loss, the sum of ``g``: ``g`` for a call
        torch reduced (``"mean"``, ``"batchmean"``; ``"sum"``: times what its ``"mean"`` divides by,
        :attr:`CapturedLoss.mean_divisor`), the sum of ``g`` over the elements of a call the caller reduced
        (``reduction="none"``: 1 for a mean, masked or not). Weighing such a call's samples by ``g`` instead
        would score a masked token loss by each sample's token count, and a second term, however small, would
        change its ranking. A ``"sum"`` times its element count counted the ``ignore_index`` tokens and class
        weights that its per-sample losses leave out: a token cross-entropy with half its labels ``-100``
        weighed twice its part next to another term."""
        if len(mapped) < 2 or any(record.grad is None for record in mapped):
            return None
        sizes: list[Tensor] = []
        for record in mapped:
            grad = record.grad.float()
            if grad.dim() == 0:
                sizes.append(grad * record.mean_divisor if record.reduction == "sum" else grad)
            elif record.unreduced is None or tuple(grad.shape) != tuple(record.unreduced.shape):
                return None
            else:
                sizes.append(grad.sum())
        if self.maximized:  # each call's part in -loss, the value the optimizers descend: exact, no sync
            sizes = [-size for size in sizes]
        largest = torch.stack([size.abs() for size in sizes]).max()
        readable = torch.isfinite(largest) & (largest > 0)  # else: an unweighted sum, as before
        # the backward's own scale (AMP's, Lightning's division) taken out: the returned loss's coefficients
        scale = self._backward_scale()
        if scale is not None:
            scale = scale.to(largest.device)
            exact = torch.isfinite(scale) & (scale != 0) & torch.isfinite(largest)
            largest = torch.where(exact, scale, largest)
            readable = readable | exact

        def part(index: int, values: Tensor) -> Tensor:
            weighted = values * sizes[index].to(values.device)
            return torch.where(
                readable.to(values.device), weighted.to(values.dtype) / largest.to(values.device), values
            )

        return part

    def describe(self) -> str:
        """A one-line account of what was captured, for error messages."""
        compiled = (
            f"{self.compiled_calls[0]} was traced into a torch.compile graph, where it cannot be captured (compile "
            "the model without its loss, e.g. compute the loss on the outputs in training_step, or set `scorer=`)"
            if self.compiled_calls
            else ""
        )
        if not self.records:
            return compiled or (
                "none of the losses it captures was called (the torch.nn.functional losses and the torch.nn loss "
                "modules that call them; not, e.g., a loss written with tensor ops)"
            )
        calls = ", ".join(
            f"{r.name}(reduction={r.reduction!r}) -> unreduced shape {r.shape}"
            + ("" if r.maps_onto_batch else f" [{r.why_not}]")
            for r in self.records
        )
        return f"captured {calls}" + (f"; {compiled}" if compiled else "")

    def unaccounted_part(
        self, loss: Tensor, constants: Iterable[Tensor] = (), limit: int = 200_000
    ) -> str | None:
        """What the captured calls leave out of ``loss`` (what the step backpropagates), or ``None``.

        Call it before ``loss``'s backward (the check reads the tensors its autograd graph saved). It walks
        the graph from ``loss`` down, stopping at what each captured call returned, and looks for a part that
        reaches the weights without passing through any captured call and that reads the batch's rows: a
        saved tensor without gradient whose first dimension is a multiple of ``B`` (the input a layer
        read), not one of ``constants`` (the module's parameters and buffers). That part (a VAE's KL written
        as ``-0.5 * torch.sum(...)``, a penalty on the logits) is in the loss that trains, per sample, but no
        score can hold it. A part that reaches the weights alone (a weight penalty) adds the same to every
        sample and is not reported; nor is anything computed from the captured calls' results (a focal
        weight, a mask, a scale). A graph of more than ``limit`` nodes is not judged."""
        root = getattr(loss, "grad_fn", None)
        boundary = {record.node for record in self.records if record.node is not None}
        if root is None or not boundary or root in boundary:
            return None
        parents: dict[Any, list[Any]] = {root: []}
        stack, leaves = [root], []
        while stack:
            node = stack.pop()
            if getattr(node, "variable", None) is not None:  # AccumulateGrad: a weight the loss trains
                leaves.append(node)
                continue
            for child, _ in node.next_functions:
                if child is None or child in boundary:
                    continue
                if child not in parents:
                    if len(parents) >= limit:
                        return None
                    parents[child] = []
                    stack.append(child)
                parents[child].append(node)
        # the part of the graph that reaches a weight other than through a captured call
        reaching, stack = set(leaves), list(leaves)
        while stack:
            for parent in parents[stack.pop()]:
                if parent not in reaching:
                    reaching.add(parent)
                    stack.append(parent)
        # it reads the batch only if it shares an activation with the captured calls (a KL on the encoder's
        # mu, a z-loss on the logits): a term on the weights alone (EWC's Fisher, a spectral norm's u, a
        # constant mask) meets them only at the weights, whatever its constants' shapes
        below, stack = set(boundary), list(boundary)
        while stack:
            for child, _ in stack.pop().next_functions:
                if child is not None and child not in below and getattr(child, "variable", None) is None:
                    if len(below) >= limit:
                        return None
                    below.add(child)
                    stack.append(child)
        if reaching.isdisjoint(below):
            return None
        kept = {_storage_key(tensor) for tensor in constants}
        for node in reaching:
            for saved in _saved_tensors(node):
                if _holds_batch_rows(saved, self.batch_size) and _storage_key(saved) not in kept:
                    return (
                        "its scores leave out part of the loss training_step returned: a part computed from "
                        "the batch's activations but not by a loss function it captures (it reads a "
                        f"{tuple(saved.shape)} tensor in {node.name()}, next to {self.describe()}). If that "
                        "part is per sample (a VAE's KL written `-0.5 * torch.sum(...)`, a z-loss on the "
                        "logits), it trains but is in no sample's score: to score the whole loss, compute it "
                        "per sample (`reduction='none'`), return it in training_step's output dict and set "
                        "`scorer=OutputKeyScorer(key=...)`. If it is a batch-level term (a mixture of "
                        "experts' load-balancing loss, which Hugging Face adds with "
                        "`output_router_logits=True`), it has no per-sample part and the captured terms' "
                        "scores are the ones to keep: filter this warning."
                    )
        return None

    def unreduced_losses(self) -> list[tuple[str, Tensor]]:
        """Each captured call's name and unreduced loss (detached), in call order; empty for a call whose
        per-sample losses were read already (which drops it)."""
        empty = torch.empty(0)
        return [(r.name, empty if r._source is None else r._source[1]) for r in self.records]

    def forget_graph(self) -> None:
        """Drop the autograd nodes kept for :meth:`unaccounted_part` (a recorded step is kept for a while)."""
        for record in self.records:
            record.node = None

    def require(self, who: str = "HardSampleReplay") -> LossCapture:
        """This capture, or a :class:`~lightning_pulse.errors.PulseRefusal` saying what was captured and what to
        configure when no captured call splits into the batch's samples."""
        if self.records and all(record.why_not == AUTOGRAD_OFF for record in self.records):
            raise PulseRefusal(
                f"{who} found no per-sample loss in training_step: its loss function ran with autograd off, "
                "so no backward reached it. Inside a reentrant activation checkpoint "
                "(torch.utils.checkpoint with use_reentrant=True, which runs its forward without autograd, "
                "then again in the backward), pass use_reentrant=False to checkpoint (Hugging Face: "
                'gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})), '
                "which trains the same and is captured. In a torch.no_grad() block (a value computed for "
                "logging), set `scorer=` to a PerSampleScorer for the loss that trains, e.g. "
                "lightning_pulse.core.per_sample_loss.OutputKeyScorer or ForwardLossScorer "
                f"({self.describe()}; batch of {self.batch_size} samples)."
            )
        if not self.maps_onto_batch:
            raise PulseRefusal(
                f"{who} found no per-sample loss in training_step ({self.describe()}; batch of {self.batch_size} "
                "samples). It captures torch.nn.functional losses (F.cross_entropy, F.mse_loss, ...) and torch.nn "
                "loss modules whose unreduced loss splits into the batch's samples, called during training_step. "
                "For any other loss, set `scorer=` to a PerSampleScorer, e.g. "
                "lightning_pulse.core.per_sample_loss.OutputKeyScorer (training_step returns per-sample losses) or "
                "ForwardLossScorer (a second, gradient-free forward pass)."
            )
        return self

    # ------------------------------------------------------------------ internals
    def _handle(
        self,
        name: str,
        original: Callable[..., Tensor],
        signature: _LossSignature,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Tensor:
        try:
            arguments = signature.arguments(args, kwargs)
        except TypeError:  # let torch raise its own error message
            return original(*args, **kwargs)
        reduction = _requested_reduction(arguments)

        weights = self.sample_weights
        if weights is not None or (reduction != "none" and _largest_input(arguments) >= SINGLE_PASS_ELEMENTS):
            # the loss once, unreduced, reduced here as torch reduces it: InfoBatch's rescale weights each sample
            # first; large logits save a second pass over them (see SINGLE_PASS_ELEMENTS)
            unreduced = original(**signature.unreduced_call(arguments))
            scored = _without_class_weights(name, original, arguments, unreduced.detach())
            record = self._record(name, arguments, scored, reduction)
            # a batch of one sample's 0-d loss, found to be that sample's (_record): weighted as its (1,) row
            rows = unreduced.reshape(1) if not unreduced.dim() and record.maps_onto_batch else unreduced
            if weights is None or _splits(tuple(rows.shape), self.batch_size):
                if reduction == "sum":
                    weights = self._sum_weights
                result = _reduce(name, arguments, rows, reduction, weights)
                result = record.watch(result if rows is unreduced else result.reshape(unreduced.shape))
                if weights is not None and reduction == "none" and result.requires_grad:
                    # after watch's hook, which records the gradient as returned (the loss's parts),
                    # unweighted
                    result.register_hook(_weigh_gradient(weights.to(result.device)))
                return result
            return record.watch(original(*args, **kwargs))  # cannot be weighted per sample: the caller's loss

        result = original(*args, **kwargs)
        if reduction == "none":
            unreduced = result.detach().clone()  # the caller may change its result in place later
        else:
            # one extra loss evaluation on the existing outputs, so that the caller's value is torch's own to
            # the last bit; on small inputs it costs about what the few calls of a torch-exact reduction do
            with torch.no_grad():
                unreduced = original(**signature.unreduced_call(arguments))
        unreduced = _without_class_weights(name, original, arguments, unreduced)
        return self._record(name, arguments, unreduced, reduction).watch(result)

    def _record(
        self, name: str, arguments: dict[str, Any], unreduced: Tensor, reduction: str
    ) -> CapturedLoss:
        if name == "ctc_loss" and reduction == "mean":  # a sample's share of the mean: its loss per target
            unreduced = _per_target_length(arguments, unreduced.detach())
        # one value for a batch of one sample: Hugging Face's regression head squeezes its (1, 1) logits and
        # labels to 0-d, as `F.mse_loss(pred.squeeze(), y)` does, where larger batches give (B,) rows. Read as
        # that sample's one row, if it was computed from the batch (a penalty on the weights is not; see
        # _reads_the_batch)
        one_value = not unreduced.dim() and self.batch_size == 1
        if one_value:
            unreduced = unreduced.reshape(1)
        # keep only what the per-sample losses need (never the model's outputs, which hold the graph)
        kept: dict[str, Any] = {}
        if name in _CLASS_WEIGHTED:
            kept = {key: arguments.get(key) for key in ("target", "weight", "ignore_index")}
        elif reduction == "batchmean":  # what torch divides the sum by: the input's first dimension
            loss_input = arguments.get("input")
            if isinstance(loss_input, Tensor) and loss_input.dim():
                kept = {"batchmean_rows": loss_input.shape[0]}
        record = CapturedLoss(
            name, reduction, tuple(unreduced.shape), source=(kept, unreduced, self.batch_size)
        )
        counted = element_weights(name, arguments, unreduced) if reduction == "sum" else None
        if counted is not None:  # what torch's "mean" divides by: the summed weight of the counted targets
            record.mean_divisor = counted.detach().sum(dtype=torch.float32)
        logits = arguments.get("input")
        if name in _CLASS_WEIGHTED and isinstance(logits, Tensor) and record.maps_onto_batch:
            rows = logits.shape[0] if logits.dim() == 2 else 0
            if (
                rows > self.batch_size
                and logits.shape[1] == rows
                and not _rows_flattened_from_batch(logits, self.batch_size)
            ):
                # a square similarity matrix over k views of each sample (SimCLR's 2B x 2B): its rows may be
                # stacked view by view, not sample by sample, so cutting them into B runs would misattribute.
                # Square by chance is a token LM whose B*T rows equal its vocabulary (a byte-level LM, V=256,
                # on 4 x 64 tokens): its rows flatten (B, T, V) sample by sample and split like any other.
                record.maps_onto_batch = False
                record.on_batch_rows = True
                views = rows // self.batch_size
                record.why_not = (
                    f"a square {rows} x {rows} logit matrix over {views} views of each sample, as "
                    "a contrastive loss computes: which rows belong to which sample cannot be known; for "
                    f"OutputKeyScorer return a ({self.batch_size},) tensor, e.g. the unreduced rows' "
                    f"`.view({views}, {self.batch_size}).mean(0)` for views stacked as [view1; view2]"
                )
        if one_value and not self._reads_the_batch(arguments):
            record.maps_onto_batch, record.on_batch_rows = False, False
            record.why_not = (
                "a 0-d loss not found to be computed from the batch's one sample: no argument of the call is a "
                "tensor of the batch or computed from one, as with a penalty on the weights (left out: it adds "
                "the same to every sample), or under autocast with a target cast from the labels (`y.float()`: "
                "give the loss the labels as the batch holds them, a view such as `y.squeeze()`, or store them "
                "in the dtype the loss needs)"
            )
        elif (
            not record.on_batch_rows
            and record.shape
            and (not record.maps_onto_batch or record.shape[0] != self.batch_size)  # B rows: the usual case
        ):
            self._check_row_origin(record, arguments)
        elif record.maps_onto_batch and not record.on_batch_rows:
            self._check_rows_are_samples(record, arguments)
        if (
            record.maps_onto_batch
            and self._batch_leaves
            and ambiguous_sample_dimension(record.shape, self.batch_size)
        ):
            record.samples_along = _samples_along(
                arguments.get("target"), self._batch_leaves, self.batch_size
            )
        self.records.append(record)
        self._per_sample_count = -1
        return record

    def _reads_the_batch(self, arguments: dict[str, Any]) -> bool:
        """Whether an argument of a loss call is (a view of) a tensor of the batch, as the squeezed labels of
        Hugging Face's regression head are, or its autograd graph read one (a layer's input, token ids; an
        input that requires grad). Identified by storage: "reads something not a parameter" also held for a
        weight penalty scaled by a ``(1,)`` buffer or indexing the weight, taken for the sample's loss. A
        graph is walked to :data:`BATCH_SEARCH_NODES` nodes at most; a batch found nowhere in them (under
        autocast, a layer reads a cast copy) leaves the loss out, the sample unscored."""
        if not self._all_batch_storages:
            return False
        tensors = [value for value in arguments.values() if isinstance(value, Tensor)]
        if any(self._is_batch_tensor(tensor) for tensor in tensors):
            return True
        return _reads(tensors, self._is_batch_tensor, leaves=True, limit=BATCH_SEARCH_NODES)

    def _is_batch_tensor(self, tensor: Tensor) -> bool:
        return tensor.numel() > 0 and _storage_key(tensor) in self._all_batch_storages

    def _check_row_origin(self, record: CapturedLoss, arguments: dict[str, Any]) -> None:
        """Mark ``record`` as not splitting into samples when none of the loss's row arguments (the tensors
        whose rows are its rows: ``input``, a margin loss's ``input1`` / ``input2``, a triplet's ``anchor``,
        ``positive``, ``negative``) is known to flatten the batch sample by sample: rows picked by an index or
        a mask, or made another way (a concatenation, a repeat). One flattened argument is enough: a
        triplet's anchors ``z.view(-1, D)`` give each row its sample, whatever picked the negatives."""
        rows = _row_arguments(arguments, record.shape[0])
        picks = {key: _rows_picked_by_index(tensor) for key, tensor in rows.items()}
        from_parameters = [key for key, pick in picks.items() if pick == "parameter"]
        if from_parameters and len(from_parameters) == len(rows):
            # `centers[present]` (a center loss's learned class centers): the rows are a parameter table's,
            # not the batch's samples', so the call adds the same to every sample, as a weight penalty does
            record.maps_onto_batch, record.on_batch_rows = False, False
            record.why_not = (
                f"its {record.shape[0]} rows ({_names(from_parameters)}) were picked from a parameter, not "
                "computed on the batch's samples (left out: it adds the same to every sample)"
            )
            return
        rows = {key: tensor for key, tensor in rows.items() if key not in from_parameters}
        if not rows:
            return
        if record.maps_onto_batch and any(
            _rows_flattened_from_batch(tensor, self.batch_size) for tensor in rows.values()
        ):
            return
        picked = [key for key in rows if picks[key] == "batch"]
        if picked:
            # `logits[mask]` (the labelled tokens only): one row per picked element, so samples hold
            # different numbers of rows; `s[i], s[j]` over all pairs of the batch (a ranking loss): a row is
            # two samples'. Cutting them into B equal runs would give one sample's rows to another. One picked
            # row per sample (B rows, a pooled last token) still splits.
            if picked == ["input"]:
                record.why_not = (
                    f"its {record.shape[0]} input rows were picked by an index or a mask (as "
                    "`logits[mask]` picks labelled tokens), so how many belong to each sample cannot be "
                    f"known; {_all_rows_way_out(record.name)}"
                )
            else:
                record.why_not = (
                    f"its {record.shape[0]} rows ({_names(picked)}) were picked by an index or a mask (as "
                    "`s[i], s[j]` pick pairs of samples), so which rows belong to which sample cannot be "
                    "known"
                )
        elif record.maps_onto_batch and (owned := self._rows_of_the_module(record, rows, arguments)):
            # an initial condition on 2B points the module holds, next to a batch of B collocation points: no
            # sample's, and no flattening of the batch either (it was refused as one)
            record.why_not = _owned_rows_reason(record, rows, owned)
            record.maps_onto_batch, record.on_batch_rows = False, False
            return
        elif record.maps_onto_batch:
            # `torch.cat([view_1, view_2])` (two augmentations, SimCLR's 2B rows) or `x.repeat(k, 1)` put
            # each sample's rows B apart, not next to each other: cutting them into B runs would give one
            # sample's rows to others. Only a flattening of a (B, ...) tensor, `logits.view(-1, V)` of
            # (B, T, V), is cut.
            what = "input rows are" if list(rows) == ["input"] else f"rows ({_names(list(rows))}) are"
            record.why_not = (
                f"its {record.shape[0]} {what} not a flattening of the batch's {self.batch_size} samples "
                "(as `logits.view(-1, V)` of `(B, T, V)` is; a time-major `(T, B, V)` flattening, "
                "`torch.cat` of two views of the batch, or a repeat puts each sample's rows apart), so which "
                "rows belong to which sample cannot be known"
            )
        elif self._joins_per_sample_items(arguments.get("target"), record.shape[0]):
            # `torch.cat` of each image's boxes (a detection loss's box term): the rows of a new tensor, which
            # no batch storage holds, so the packed-row check below read none and left the term out
            record.why_not = (
                f"its {record.shape[0]} rows' target joins the batch's per-sample items along their rows (as "
                "`torch.cat` of each image's boxes does), so which rows belong to which sample cannot be "
                "known; to score it, sum each sample's rows (`index_add_`) in a (B,) loss for OutputKeyScorer"
            )
        elif self._reads_packed_rows(record, rows, arguments):
            # a node loss on a graph batch, a token loss on packed sequences: N rows of the batch, not a
            # multiple of B. Left out as a penalty, the score was the other terms alone, and whether a step
            # refused depended on whether its N happened to be a multiple of B
            record.why_not = (
                f"its {record.shape[0]} rows are computed from a batch tensor of {record.shape[0]} rows "
                "(packed rows: a graph batch's nodes, packed sequences' tokens), so which rows belong to "
                "which sample cannot be known"
            )
        else:
            return
        record.maps_onto_batch = False
        record.on_batch_rows = True

    def _rows_of_the_module(
        self, record: CapturedLoss, rows: dict[str, Tensor], arguments: dict[str, Any]
    ) -> str | None:
        """The module's own tensors that ``rows`` (a call's row arguments) are computed from, named, when their
        autograd graph reads those and nothing else: no tensor of the batch, nor one made in ``training_step``
        (a copy, an augmentation, points drawn afresh), which may be the batch's; else ``None``.

        A PINN's initial-condition term on ``B`` points held as a buffer has the batch's row count by chance:
        split over the samples, IC point ``k``'s error went to whichever collocation point sat at row ``k``
        (a held-out sweep: rank correlation 0.03 of the scores with the points' own residuals). The batch is
        told by what the graph reads, not by autograd ancestry, which ``x.clone().requires_grad_(True)`` (the
        PINN's input made ready for its derivatives) cuts: that leaf is no tensor of the module's, so the
        residual term stays the samples'. The module's tensors are matched by storage, or by value for a copy
        (autocast's cast of a buffer, ``self.ic.clone().requires_grad_()``). Any argument of the call that is a
        batch tensor (the labels) makes it the batch's at once; otherwise the graph is walked, at most
        :data:`BATCH_SEARCH_NODES` nodes (beyond: the batch's), once per call site (each call of a line its
        own) and row count over a fit where the site gave one answer (a loop or a helper that computes both a
        batch term and a buffer's is walked every time once both were seen)."""
        if self._module is None or not rows:
            return None
        if any(isinstance(value, Tensor) and self._is_batch_tensor(value) for value in arguments.values()):
            return None
        # a verdict holds for the row counts walked at the site in an earlier step only: a helper's one site
        # computes a residual of B rows at every step, and the fixed points' term only at a batch of as many rows
        # (a trailing batch, a replay's smaller one), which the residual's verdict ("the batch's") did not see
        site, count = (record.name, _call_site(), record.shape[1:]), record.shape[0]
        found = self.row_sources.get(site)
        if found is not None and len(found[0]) == 1 and found[1].get(count, self.serial) != self.serial:
            return next(iter(found[0]))
        if self._known is None:
            batch = _NamedTensors([("batch", leaf) for leaf in self._batch_leaves])
            self._known = (batch, _NamedTensors(_module_tensors(self._module)))
        owned = _read_only(list(rows.values()), *self._known, BATCH_SEARCH_NODES)
        if found is None:
            found = self.row_sources[site] = (set(), {})
        found[0].add(owned)
        found[1].setdefault(count, self.serial)
        return owned

    def _joins_per_sample_items(self, target: Any, count: int) -> bool:
        """Whether ``target`` (``count`` rows) has the rows, trailing shape and dtype of the batch's
        per-sample items joined (:func:`_joined_item_shapes`)."""
        return (
            isinstance(target, Tensor)
            and not target.requires_grad
            and target.dim() >= 1
            and (count, tuple(target.shape[1:]), target.dtype) in self._joined_items
        )

    def _reads_packed_rows(
        self, record: CapturedLoss, rows: dict[str, Tensor], arguments: dict[str, Any]
    ) -> bool:
        """Whether a call of ``count`` rows (not a multiple of ``B``) is computed on the batch's rows: its
        target is (a view of) a batch tensor of ``count`` rows, or a tensor its rows' autograd graph read (a
        layer's input, token ids) is a batch tensor of ``count`` rows, or of ``count + 1`` (a next-token
        shift, ``logits[:-1]``). Rows are counted along the first dimension, the first two flattened (a
        ``(1, T)`` row of packed tokens) or all elements. A term of a constant size (a load-balancing loss
        over ``E`` experts), over the weights, or on a table of the module's own
        reads none: a penalty, left out."""
        count = record.shape[0]
        target = arguments.get("target")
        if isinstance(target, Tensor) and self._is_packed_batch_tensor(target, count):
            return True
        if count not in self._batch_rows and count + 1 not in self._batch_rows:
            return False
        site = (record.name, _call_site(), record.shape[1:])
        if site in self.unread_sites:
            return False
        found = any(
            _reads(tensor, functools.partial(self._is_packed_batch_tensor, count=count))
            for tensor in rows.values()
        )
        if not found:
            self.unread_sites.add(site)
        return found

    def _is_packed_batch_tensor(self, tensor: Tensor, count: int) -> bool:
        # by storage, so that a view the module reads (`ids[None]`, `ids[1:]`) is the batch tensor it views
        return (
            not tensor.requires_grad
            and tensor.dim() >= 1
            and bool(self._batch_storages)
            and _storage_key(tensor) in self._batch_storages
            and not _row_counts(tensor).isdisjoint((count, count + 1))
        )

    def _check_rows_are_samples(self, record: CapturedLoss, arguments: dict[str, Any]) -> None:
        """For a call of ``B`` rows (the usual case, cheap: a few autograd nodes): mark it as not the samples'
        when its rows are a parameter's (``F.mse_loss(layer.weight, w0)``, an L2-SP penalty on a weight of
        ``B`` rows: left out, it adds the same to every sample) or the features of a product that sums over
        the batch (Barlow Twins' ``z1.T @ z2``: refused as a ``D x D`` matrix of another ``D`` is)."""
        rows = {
            key: value
            for key, value in arguments.items()
            if key in _INPUTS and isinstance(value, Tensor) and value.requires_grad and value.dim() >= 1
        }
        if rows and all(_computed_from_parameters(tensor) for tensor in rows.values()):
            record.maps_onto_batch, record.on_batch_rows = False, False
            record.why_not = (
                f"its {record.shape[0]} rows ({_names(list(rows))}) are a parameter's, or computed from "
                "parameters alone, not the batch's samples (left out: it adds the same to every sample)"
            )
            return
        if owned := self._rows_of_the_module(record, rows, arguments):
            record.maps_onto_batch, record.on_batch_rows = False, False
            record.why_not = _owned_rows_reason(record, rows, owned)
            return
        logits = arguments.get("input")
        if isinstance(logits, Tensor) and _rows_sum_over_the_batch(logits, self.batch_size):
            record.maps_onto_batch, record.on_batch_rows = False, True
            record.why_not = (
                f"its {record.shape[0]} input rows are the columns of a matrix product's transposed first "
                f"operand, summed over the batch's {self.batch_size} samples (a cross-correlation or "
                "covariance matrix, `z1.T @ z2`): they are features, not samples"
            )


#: the arguments of a loss whose rows are its rows (the margin, embedding and triplet losses have several)
_INPUTS = frozenset({"input", "input1", "input2", "anchor", "positive", "negative"})


def _owned_rows_reason(record: CapturedLoss, rows: dict[str, Tensor], owned: str) -> str:
    return (
        f"its {record.shape[0]} rows ({_names(list(rows))}) are computed from the module's own tensors "
        f"({owned}) and no tensor of the batch: points the module holds (an initial or boundary condition's, "
        "anchors) whose count matches the batch's by chance (left out: it adds the same to every sample)"
    )


def _module_tensors(module: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """A module's parameters, buffers and plain tensor attributes (its submodules' too), by name."""
    named: list[tuple[str, Tensor]] = [*module.named_parameters(), *module.named_buffers()]
    for prefix, child in module.named_modules():
        named += [
            (f"{prefix}.{key}" if prefix else key, value)
            for key, value in vars(child).items()
            if isinstance(value, Tensor) and not isinstance(value, torch.nn.Parameter)
        ]
    return named


class _NamedTensors:
    """Tensors by name, found by storage (a view) or by value (a copy: a cast, a clone)."""

    def __init__(self, named: list[tuple[str, Tensor]]) -> None:
        self.by_storage: dict[int, str] = {}
        self.by_count: dict[int, list[tuple[str, Tensor]]] = {}
        for name, tensor in named:
            if tensor.numel() > 1 and tensor.device.type != "meta":
                self.by_storage.setdefault(_storage_key(tensor), name)
                self.by_count.setdefault(tensor.numel(), []).append((name, tensor))

    def name_of(self, tensor: Tensor) -> str | None:
        """The name of the tensor that ``tensor`` is (a view of) or a copy of, else ``None``."""
        name = self.by_storage.get(_storage_key(tensor))
        if name is not None:
            return name
        for name, owned in self.by_count.get(tensor.numel(), ()):
            try:
                copy = owned.detach().reshape(-1).to(device=tensor.device, dtype=tensor.dtype)
                if torch.equal(tensor.detach().reshape(-1), copy):
                    return name
            except (RuntimeError, TypeError, NotImplementedError):  # a wrapped or sparse tensor: not read
                continue
        return None


def _constant(tensor: Tensor) -> bool:
    """Whether every element of ``tensor`` is the same (``torch.zeros_like(res)``, the ones a derivative's
    backward reads): it holds no sample. One device sync."""
    try:
        flat = tensor.detach().reshape(-1)
        return bool((flat == flat[0]).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


#: nodes whose ``None`` input is an optional one left out (a convolution or a norm without bias or affine
#: weights), not a tensor without gradient read unseen (``x + w`` saves neither operand)
_OPTIONAL_INPUTS = frozenset(
    {
        "ConvolutionBackward0",
        "NativeLayerNormBackward0",
        "NativeBatchNormBackward0",
        "NativeGroupNormBackward0",
        "CudnnBatchNormBackward0",
        "MiopenBatchNormBackward0",
    }
)


def _read_only(tensors: list[Tensor], batch: _NamedTensors, module: _NamedTensors, limit: int) -> str | None:
    """The names of the module's tensors (``module``) that ``tensors``' autograd graphs read, when they read
    nothing else that holds data: every saved tensor without gradient (what a layer read) and every leaf that
    is not a parameter is one of the module's (not a tensor of the ``batch`` or a copy of one, as
    ``x.clone().requires_grad_(True)`` is, nor a tensor made in the step), or a constant (the ones a
    derivative's backward reads); ``"its parameters and constants alone"`` when nothing else. ``None`` at the
    first other one, at an input read unseen (an addition of a tensor without gradient saves it nowhere) and
    past ``limit`` nodes."""
    names: set[str] = set()

    def own(tensor: Tensor) -> bool:
        if tensor.numel() <= 1:  # a scalar holds no sample
            return True
        if batch.name_of(tensor) is not None:
            return False
        name = module.name_of(tensor)
        if name is not None:
            names.add(name)
            return True
        return _constant(tensor)

    roots = []
    for tensor in tensors:
        if tensor.grad_fn is not None:
            roots.append(tensor.grad_fn)
        elif not isinstance(tensor, torch.nn.Parameter) and not own(tensor):
            return None
    seen, stack = set(roots), list(roots)
    while stack:
        if len(seen) > limit:
            return None
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:  # a leaf: a parameter, or an input made ready for its derivatives
            if not isinstance(variable, torch.nn.Parameter) and not own(variable):
                return None
            continue
        unseen = type(node).__name__ not in _OPTIONAL_INPUTS and any(
            child is None for child, _ in node.next_functions
        )
        for saved in _saved_tensors(node):
            if saved.requires_grad:  # an activation or a weight: the graph below it is walked
                continue
            unseen = False
            if not own(saved):
                return None
        if unseen:
            return None
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return ", ".join(f"`{name}`" for name in sorted(names)) or "its parameters and constants alone"


def _computed_from_parameters(tensor: Tensor, limit: int = 4) -> bool:
    """Whether ``tensor`` is an ``nn.Parameter`` or a tensor of a parameter's shape computed from parameters
    alone within ``limit`` autograd nodes (``w - w0``, a weight-norm parametrization): no tensor of the
    batch's is in it. A graph that saved a tensor without gradient (the batch a layer read) is not."""
    if tensor.grad_fn is None:
        return isinstance(tensor, torch.nn.Parameter)
    nodes, shapes, seen, stack = [], set(), {tensor.grad_fn}, [tensor.grad_fn]
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:
            if not isinstance(variable, torch.nn.Parameter):
                return False
            shapes.add(tuple(variable.shape))
            continue
        nodes.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                if len(seen) >= limit:
                    return False
                seen.add(child)
                stack.append(child)
    if tuple(tensor.shape) not in shapes:  # a parameter broadcast to B rows (`bias.expand(B, D)`) is per row
        return False
    return not any(
        saved.dim() >= 1 and not saved.requires_grad for node in nodes for saved in _saved_tensors(node)
    )


#: nodes that keep a tensor's rows where they are (element-wise with a scalar or a broadcast constant, a cast)
_ROW_KEEPING = frozenset(
    {
        "DivBackward0",
        "DivBackward1",
        "MulBackward0",
        "MulBackward1",
        "AddBackward0",
        "AddBackward1",
        "SubBackward0",
        "SubBackward1",
        "NegBackward0",
        "CloneBackward0",
        "ToCopyBackward0",
    }
)


def _rows_sum_over_the_batch(tensor: Tensor, batch_size: int, depth: int = 4) -> bool:
    """Whether ``tensor``'s rows come, through element-wise nodes, from a 2-D matrix product whose first
    operand is a transposed ``(B, D)`` activation (``z1.T @ z2``): the product sums over the batch's rows,
    and its rows are ``z1``'s features. A weight transposed (``W.T @ h``) is not the batch's."""
    node = _through_views(tensor.grad_fn, depth - 1, through=_ROW_KEEPING)
    if node is None or type(node).__name__ != "MmBackward0":
        return False
    operand = node.next_functions[0][0]
    if operand is None or not _transposes_a_matrix(operand):
        return False
    source = operand.next_functions[0][0]
    if source is None or isinstance(getattr(source, "variable", None), torch.nn.Parameter):
        return False
    try:
        summed = int(node._saved_mat2_sym_sizes[0])
    except (AttributeError, RuntimeError, TypeError, IndexError):
        return False
    return summed == batch_size


def _transposes_a_matrix(node: Any) -> bool:
    name = type(node).__name__
    try:
        if name == "TBackward0":
            return True
        if name == "PermuteBackward0":
            return tuple(node._saved_dims) == (1, 0)
        if name == "TransposeBackward0":
            return {int(node._saved_dim0) % 2, int(node._saved_dim1) % 2} == {0, 1}
    except (AttributeError, RuntimeError, TypeError):
        return False
    return False


#: per autograd node type, the names of the attributes that hold what it saved for its backward
_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_tensors(node: Any) -> Iterator[Tensor]:
    """The tensors an autograd node saved for its backward (none once a backward freed them)."""
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = tuple(
            name
            for name in dir(type(node))
            # what it read, not what it computed (`result`: a weight norm's norms, computed from the weights)
            if name.startswith("_saved_")
            and not name.startswith("_saved_result")
            and not name.endswith(("_sizes", "_strides"))
        )
    for name in names:
        try:
            value = getattr(node, name)
        except (RuntimeError, AttributeError):
            continue
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from (item for item in value if isinstance(item, Tensor))


def _holds_batch_rows(tensor: Tensor, batch_size: int) -> bool:
    """A tensor without gradient whose first dimension is a multiple of ``B``: what a layer reads of the batch
    (its input, ``(B, ...)``, or flattened, ``(B*T, ...)``; token ids; a dropout mask)."""
    return (
        not tensor.requires_grad
        and tensor.dim() >= 1
        and tensor.numel() > 0
        and tensor.shape[0] >= batch_size
        and tensor.shape[0] % batch_size == 0
    )


def _reads(
    tensor: Tensor | Sequence[Tensor],
    wanted: Callable[[Tensor], bool],
    leaves: bool = False,
    limit: int | None = None,
) -> bool:
    """Whether ``tensor``'s autograd graph (or one of theirs, for several) saved a tensor that is ``wanted``: what
    a layer read (its input, token ids); with ``leaves``, or starts at a ``wanted`` leaf (an input that requires
    grad). Each node once. Without ``limit`` the whole graph is walked, however deep: the token ids a deep
    model's embedding read are at its bottom, and a walk cut short would answer "reads none" (a penalty, left
    out of the score) for a term that is the batch's (a 48-layer transformer: some 2,600 nodes, a few ms, once
    per call site); with it, at most ``limit`` nodes (a walk every step)."""
    tensors = [tensor] if isinstance(tensor, Tensor) else list(tensor)
    roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen, stack = set(roots), roots
    while stack and (limit is None or len(seen) <= limit):
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:
            if leaves and wanted(variable):
                return True
            continue
        if any(wanted(saved) for saved in _saved_tensors(node)):
            return True
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return False


def _joined_item_shapes(batch: Any, batch_size: int, depth: int = 0) -> frozenset[tuple[Any, ...]]:
    """``(rows, trailing shape, dtype)`` of each field of the per-sample items a list or tuple of ``B`` items
    in ``batch`` holds (a detection batch's target dicts: their ``boxes`` ``(k_i, 4)``), joined along the
    first dimension as ``torch.cat`` joins them. Items of at most two dimensions (images are not joined)."""
    if depth > 4 or isinstance(batch, (Tensor, str, bytes)):
        return frozenset()
    if isinstance(batch, Mapping):
        found: frozenset[tuple[Any, ...]] = frozenset()
        for value in batch.values():
            found |= _joined_item_shapes(value, batch_size, depth + 1)
        return found
    if not isinstance(batch, (list, tuple)):
        return frozenset()
    if len(batch) == batch_size and batch_size >= 2:
        fields: dict[Any, list[Tensor]] = {}
        for item in batch:
            pairs = item.items() if isinstance(item, Mapping) else [(None, item)]
            for key, value in pairs:
                if isinstance(value, Tensor) and 1 <= value.dim() <= 2:
                    fields.setdefault(key, []).append(value)
        joined = set()
        for tensors in fields.values():
            # an image with no boxes may hold `torch.tensor([])`: no rows, whatever its shape
            kinds = {(tuple(t.shape[1:]), t.dtype) for t in tensors if t.numel()}
            if len(tensors) == batch_size and len(kinds) == 1:
                joined.add((sum(int(t.shape[0]) for t in tensors if t.numel()), *kinds.pop()))
        return frozenset(joined)
    found = frozenset()
    for value in batch:
        found |= _joined_item_shapes(value, batch_size, depth + 1)
    return found


def _row_counts(tensor: Tensor) -> frozenset[int]:
    """The row counts a loss over ``tensor``'s rows may have: its first dimension, its first two flattened (a
    ``(1, T)`` row of packed tokens, read as ``T`` rows) and its elements."""
    counts = {int(tensor.shape[0]), tensor.numel()}
    if tensor.dim() >= 2:
        counts.add(int(tensor.shape[0]) * int(tensor.shape[1]))
    return frozenset(counts)


_TORCH_DIR = os.path.dirname(torch.__file__)


def _call_site() -> tuple[str, int, int]:
    """File, line and bytecode offset of the loss call in the caller's code: the first frame outside this
    module and torch (``nn.CrossEntropyLoss`` calls the functional form from torch). The offset tells two calls
    on one line apart (``F.mse_loss(r, 0) + F.mse_loss(net(ic), u0)``); a loop or a helper stays one site."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(_TORCH_DIR)
    ):
        frame = frame.f_back
    return ("", 0, 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_lasti)


def _storage_key(tensor: Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(tensor)


#: arguments whose rows are not the loss's rows (class weights, CTC's lengths), even when their sizes agree
_NOT_ROWS = frozenset({"weight", "pos_weight", "input_lengths", "target_lengths"})


def _row_arguments(arguments: dict[str, Any], rows: int) -> dict[str, Tensor]:
    """The tensor arguments of a loss call that autograd can trace back and that hold its ``rows`` rows: its
    inputs (``input``; ``input1``, ``input2``; ``anchor``, ``positive``, ``negative``) and a target computed
    with gradient. A target from the batch, with no autograd history, has nothing to tell."""
    return {
        key: value
        for key, value in arguments.items()
        if isinstance(value, Tensor)
        and value.grad_fn is not None
        and value.dim() >= 1
        and value.shape[0] == rows
        and key not in _NOT_ROWS
    }


def _names(keys: list[str]) -> str:
    return ", ".join(f"`{key}`" for key in keys)


#: nodes that reshape without moving elements; their input's shape tells where the rows came from
_RESHAPES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})


def _rows_flattened_from_batch(tensor: Tensor, batch_size: int, depth: int = 4) -> bool:
    """Whether ``tensor``'s rows (a multiple of ``batch_size``) come from flattening a tensor whose first
    dimension is the batch's (sample-major: each sample's rows next to each other): a reshape of a
    ``(B, d1, ...)`` tensor whose leading sizes multiply to the row count, found within ``depth`` autograd nodes
    (row-wise ops such as ``log_softmax``, a linear layer or a cast lie between). The search never passes a
    node that moves rows between samples (a concatenation, a stack, a repeat, a pick by index): rows made that
    way are not known to be sample-major."""
    rows = tensor.shape[0]
    frontier = [tensor.grad_fn]
    for _ in range(depth):
        parents = []
        for node in frontier:
            if node is None or type(node).__name__ in _ROW_MOVES:
                continue
            sizes = getattr(node, "_saved_self_sym_sizes", None) if type(node).__name__ in _RESHAPES else None
            if sizes is not None and len(sizes) >= 2 and int(sizes[0]) == batch_size:
                leading = 1
                for size in sizes[:-1]:
                    leading *= int(size)
                    if leading == rows:
                        return True
            parents += [parent for parent, _ in node.next_functions if parent is not None]
        frontier = parents
    return False


#: autograd nodes that select rows by an index tensor or a mask
_ROW_PICKS = frozenset({"IndexBackward0", "MaskedSelectBackward0", "IndexSelectBackward0"})
#: autograd nodes whose output rows are not their input's rows in order
_ROW_MOVES = _ROW_PICKS | {
    "CatBackward0",
    "StackBackward0",
    "RepeatBackward0",
    "RepeatInterleaveBackward0",
    "GatherBackward0",
    "PermuteBackward0",
    "TransposeBackward0",
    "TBackward0",
}
#: nodes that pass one input through unchanged in its rows (looked through on the way to a pick)
_PASS_THROUGH = frozenset(
    {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "ToCopyBackward0", "CloneBackward0"}
)


#: the captured losses with an ``ignore_index`` argument: a label that leaves its row out of the loss
_WITH_IGNORE_INDEX = frozenset({"cross_entropy", "nll_loss"})


def _all_rows_way_out(name: str) -> str:
    """How to compute loss ``name`` on all of the batch's rows instead of those a mask picks: with
    ``ignore_index`` where it has one; else unreduced and averaged over the mask, whose zeros the capture
    reads from the gradient and leaves out of each sample's score (``binary_cross_entropy_with_logits``,
    ELECTRA's loss over its attention mask, has no ``ignore_index``)."""
    where = "(for a model that computes its loss inside, in `training_step` from its logits)"
    if name in _WITH_IGNORE_INDEX:
        return f"compute it on all rows with `ignore_index` for the unlabelled ones {where}"
    return (
        f"compute it on all rows with `reduction='none'` and average it over the mask, "
        f"`(loss * mask).sum() / mask.sum()` {where}"
    )


def _rows_picked_by_index(tensor: Tensor, depth: int = 4) -> str | None:
    """``"batch"`` when ``tensor`` was made by picking elements with an index or a mask (through at most
    ``depth`` views and dtype casts): then its rows are not a reshape of the batch; ``"parameter"`` when the
    picked tensor is an ``nn.Parameter`` itself (through as many views and casts: ``centers[labels]``), whose
    rows are not the batch's at all; ``None`` otherwise."""
    node = _through_views(tensor.grad_fn, depth)
    if node is None or type(node).__name__ not in _ROW_PICKS:
        return None
    source = _through_views(_first_input(node), depth)
    return "parameter" if isinstance(getattr(source, "variable", None), torch.nn.Parameter) else "batch"


def _through_views(node: Any, depth: int, through: frozenset[str] = _PASS_THROUGH) -> Any:
    """The first autograd node from ``node`` on that is not one of ``through`` (views and casts), following
    each node's first input (at most ``depth`` steps)."""
    for _ in range(depth):
        if node is None or type(node).__name__ not in through:
            return node
        node = _first_input(node)
    return node


def _first_input(node: Any) -> Any:
    """The autograd node of ``node``'s first input that has one, or ``None``."""
    return next((parent for parent, _ in node.next_functions if parent is not None), None)


def _largest_input(arguments: dict[str, Any]) -> int:
    """The element count of a loss call's largest floating-point tensor argument."""
    return max(
        (v.numel() for v in arguments.values() if isinstance(v, Tensor) and v.is_floating_point()), default=0
    )


def _per_sample_of(
    name: str,
    arguments: dict[str, Any],
    unreduced: Tensor,
    batch_size: int,
    reduction: str,
    grad: Tensor | None = None,
) -> Tensor | None:
    per_sample = _per_sample_on_cpu(name, arguments, unreduced, batch_size, reduction, grad)
    if per_sample is _NOT_ON_CPU:
        with torch.no_grad():
            weights = element_weights(name, arguments, unreduced)
            per_sample = per_sample_from_unreduced(
                unreduced, batch_size, weights, reduction, grad, arguments.get("batchmean_rows")
            )
    return per_sample  # type: ignore[return-value]


def concat_per_sample(captures: list[LossCapture]) -> np.ndarray | None:
    """The per-sample losses of several captures, one after another, as one float32 host array.

    Captures that each hold one CPU call of the same loss (same reduction, elements per sample and
    ``ignore_index``, no class weights), the usual case of consecutive training steps, are split in one
    vectorized pass, as if they were one large batch; anything else goes capture by capture. ``None`` if a
    capture has no per-sample loss.
    """
    sources = [_lone_source(capture) for capture in captures]
    first = sources[0] if sources else None
    if first is not None and all(source is not None and source[0] == first[0] for source in sources[1:]):
        (name, reduction, width, ignore_index, class_indices, by_gradient, batchmean_rows), *_ = first
        rows = np.concatenate([source[1].detach().numpy().reshape(-1) for source in sources])
        total = sum(source[3] for source in sources)
        arguments: dict[str, Any] = {}
        if reduction == "batchmean":  # the same input rows per sample in each capture
            arguments = {"batchmean_rows": round(batchmean_rows * total)}
        if class_indices:
            targets = np.concatenate([source[2].numpy().reshape(-1) for source in sources])
            arguments = {"target": torch.from_numpy(targets), "ignore_index": ignore_index, "weight": None}
        kept = None
        if by_gradient:  # each capture's own gradient says whether it is a mask; if not, all elements count
            masks = [
                _kept_by_gradient_on_cpu(source[4], source[1].detach().numpy().reshape(source[3], -1))
                for source in sources
            ]
            kept = np.concatenate(
                [
                    np.ones(source[1].numel(), bool) if mask is None else mask.reshape(-1)
                    for mask, source in zip(masks, sources)
                ]
            )
        per_sample = _per_sample_on_cpu(name, arguments, torch.from_numpy(rows), total, reduction, kept=kept)
        if isinstance(per_sample, Tensor) and per_sample.numel() == total:
            return per_sample.numpy()
    parts = [capture.per_sample() for capture in captures]
    if any(part is None for part in parts):
        return None
    return torch.cat([part.detach().float().cpu().reshape(-1) for part in parts]).numpy()  # type: ignore[union-attr]


def _lone_source(capture: LossCapture) -> tuple[tuple, Tensor, Tensor | None, int, Tensor | None] | None:
    """``(key, unreduced, targets, batch size, element gradient)`` of a capture holding exactly one CPU float
    loss call whose per-sample losses have not been computed yet; ``None`` otherwise. Captures with equal keys
    can be split together."""
    if len(capture.records) != 1:
        return None
    record = capture.records[0]
    source = record._source
    if source is None or not record.maps_onto_batch:
        return None
    arguments, unreduced, batch_size = source
    if not unreduced.is_cpu or unreduced.dtype not in (torch.float32, torch.float64):
        return None
    target = arguments.get("target")
    class_indices = isinstance(target, Tensor) and not target.is_floating_point()
    if class_indices and (not target.is_cpu or arguments.get("weight") is not None):
        return None
    grad = record.element_grad(batch_size)
    if grad is not None and not grad.is_cpu:
        return None
    width = unreduced.numel() // batch_size
    key = (
        record.name,
        record.reduction,
        width,
        arguments.get("ignore_index", -100),
        class_indices,
        grad is not None,
        arguments.get("batchmean_rows", unreduced.shape[0]) / batch_size,  # input rows per sample
    )
    return key, unreduced, target if class_indices else None, batch_size, grad


_NOT_ON_CPU = object()


def _per_sample_on_cpu(
    name: str,
    arguments: dict[str, Any],
    unreduced: Tensor,
    batch_size: int,
    reduction: str,
    grad: Tensor | None = None,
    kept: np.ndarray | None = None,
) -> Tensor | None | object:
    """:func:`per_sample_from_unreduced` in NumPy for float CPU tensors, where a step's few hundred values
    cost far less than the same torch calls; ``_NOT_ON_CPU`` when it does not apply (GPU, bf16, a gradient
    elsewhere). ``kept``: the elements that count, already read from the gradient (instead of ``grad``).

    Kept to as few NumPy calls as the case needs: this runs on every training step.
    """
    if not unreduced.is_cpu or unreduced.dtype not in (torch.float32, torch.float64):
        return _NOT_ON_CPU
    target = arguments.get("target")
    class_indices = name in _CLASS_WEIGHTED and isinstance(target, Tensor) and not target.is_floating_point()
    if (class_indices and not target.is_cpu) or (grad is not None and not grad.is_cpu):
        return _NOT_ON_CPU
    shape = unreduced.shape
    if not shape or shape[0] < batch_size or shape[0] % batch_size or unreduced.numel() == 0:
        return None
    rows = unreduced.detach().numpy().reshape(batch_size, -1)
    if reduction == "batchmean":
        sums = torch.from_numpy(rows.sum(axis=1, dtype=np.float32))  # a copy: never a view of the loss
        return _batchmean_share(sums, batch_size, arguments.get("batchmean_rows", shape[0]))
    if rows.shape[1] == 1 and not class_indices:
        return torch.from_numpy(rows[:, 0].astype(np.float32))  # astype copies: never a view of the loss
    if grad is not None:
        kept = _kept_by_gradient_on_cpu(grad, rows)
    if kept is not None:
        kept = kept.reshape(batch_size, -1)
    if not class_indices and kept is None:
        return torch.from_numpy(rows.mean(axis=1, dtype=np.float32))
    counted = None  # what each element counts for in the mean: 1 each, unless the targets say otherwise
    if class_indices:
        targets = target.numpy().reshape(batch_size, -1)
        ignored = targets == arguments.get("ignore_index", -100)
        weight = arguments.get("weight")
        if weight is not None:
            counted = weight.detach().cpu().float().numpy()[np.where(ignored, 0, targets)]
            counted[ignored] = 0.0
        elif rows.shape[1] == 1:  # one target per sample: its own loss, 0 where it is ignored
            values = rows[:, 0].astype(np.float32)
            if ignored.any():
                values[ignored[:, 0]] = 0.0
            return torch.from_numpy(values)
        elif kept is None:
            return torch.from_numpy(
                _mean_over_counted(rows, rows.shape[1] - ignored.sum(axis=1, dtype=np.float32))
            )
        else:
            counted = ~ignored
    if kept is not None:  # the caller's own reduction over a mask: the elements it leaves out do not count
        rows = rows * kept
        counted = kept if counted is None else counted * kept
    assert counted is not None  # class indices, or a mask, said what counts
    return torch.from_numpy(_mean_over_counted(rows, counted.sum(axis=1, dtype=np.float32)))


def _kept_by_gradient_on_cpu(grad: Tensor, rows: np.ndarray) -> np.ndarray | None:
    """:func:`_kept_by_gradient` in NumPy: the ``(B, elements)`` bool mask of the elements a caller's own
    reduction keeps, or ``None`` where its gradient is not such a mask (then the plain mean). Every element
    kept is ``None`` too: the plain mean, without a mask."""
    magnitude = np.abs(grad.detach().to(torch.float32).numpy().reshape(rows.shape))
    kept = magnitude > 0
    if kept.all():
        return None
    total = float(magnitude.sum())
    if not (math.isfinite(total) and total > 0):  # all zero (a loss scaled by 0), or an overflowed AMP step
        return None
    infinity = rows.dtype.type(np.inf)
    evidence = ~kept & (rows != 0)  # left out, with a loss that would have counted (zero-filled pads do not)
    both = kept.any(axis=1) & evidence.any(axis=1)
    dropped_top = np.where(evidence, rows, -infinity).max(axis=1)
    dropped_bottom = np.where(evidence, rows, infinity).min(axis=1)
    kept_bottom = np.where(kept, rows, infinity).min(axis=1)
    kept_top = np.where(kept, rows, -infinity).max(axis=1)
    one_sided = (dropped_top <= kept_bottom) | (dropped_bottom >= kept_top)
    if both.any() and one_sided[both].all():
        return None  # a threshold on the loss: the lowest (or highest) losses left out in every sample
    return kept


def _mean_over_counted(rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each row's sum over its ``counts``; 0 for a row with nothing counted (every token of the sample ignored:
    it adds nothing to the loss, so it is the easiest sample, not an unseen one to train every time)."""
    sums = rows.sum(axis=1, dtype=np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts != 0, sums / counts, np.float32(0.0)).astype(np.float32, copy=False)


def time_major_losses(capture: LossCapture, batch: Any) -> list[str]:
    """The captured class-index losses (cross-entropy, NLL) whose flattened targets are a ``(B, T)`` integer
    tensor of ``batch`` transposed: computed time-major (``(T, B)`` flattened, e.g. a ``batch_first=False``
    model), so splitting them into ``B`` consecutive blocks would mix samples. Read before the per-sample
    losses are computed (the targets are dropped then); a loss whose targets match no batch tensor is not
    judged."""
    size = capture.batch_size
    leaves = [
        leaf
        for leaf in tree_leaves(batch)
        if isinstance(leaf, Tensor)
        and leaf.dim() == 2
        and leaf.shape[0] == size
        and leaf.shape[1] > 1
        and not leaf.is_floating_point()
    ]
    found = []
    for record in capture.records:
        target = None if record._source is None else record._source[0].get("target")
        if not isinstance(target, Tensor) or target.is_floating_point() or target.numel() <= size:
            continue
        flat = target.reshape(-1)
        for leaf in (leaf.to(flat.device) for leaf in leaves if leaf.numel() == flat.numel()):
            if torch.equal(flat, leaf.reshape(-1)):
                break
            if torch.equal(flat, leaf.t().reshape(-1)):
                found.append(record.name)
                break
    return found


def time_major_refusal(capture: LossCapture, batch: Any) -> str | None:
    """Why HardSampleReplay must refuse ``capture``'s losses (see :func:`time_major_losses`), after its name,
    with the way out; ``None`` if they split into samples correctly."""
    names = time_major_losses(capture, batch)
    if not names:
        return None
    return (
        f"cannot split the module's {names[0]} into samples: it is computed on time-major tokens (its flattened "
        "targets are a batch tensor transposed), so each sample's share would mix samples. Flatten the logits and "
        "targets batch-first (batch_first=True), or set `scorer=` to a PerSampleScorer."
    )


# ---------------------------------------------------------------------- scorers
class PerSampleScorer:
    """Computes one loss per sample for modules whose loss :class:`LossCapture` cannot see.

    Subclass and implement :meth:`__call__`; pass an instance (or, in YAML, a ``class_path``) as
    ``HardSampleReplay(scorer=...)``. It is called after ``training_step`` on the batch the step trained on.
    """

    def score(self, pl_module: torch.nn.Module, batch: Any, outputs: Any, batch_size: int) -> Tensor:
        """``(batch_size,)`` detached losses from :meth:`__call__`, without gradient, their count checked.

        Raises:
            RuntimeError: if the scorer returns another number of losses.
        """
        with torch.no_grad():
            losses = torch.as_tensor(self(pl_module, batch, outputs, batch_size)).detach().flatten()
        if losses.numel() != batch_size:
            raise RuntimeError(
                f"The scorer {type(self).__name__} returned {losses.numel()} losses for a batch of {batch_size} "
                "samples."
            )
        return losses

    def __call__(self, pl_module: torch.nn.Module, batch: Any, outputs: Any, batch_size: int) -> Tensor:
        """Return a ``(batch_size,)`` tensor of per-sample losses (detached; any float dtype).

        Args:
            pl_module: the LightningModule being trained.
            batch: the batch ``training_step`` received (after any composition).
            outputs: what ``training_step`` returned.
            batch_size: the number of samples in ``batch``.
        """
        raise NotImplementedError


def _pick(batch: Any, key: int | str) -> Any:
    try:
        return batch[key]
    except (KeyError, IndexError, TypeError) as error:
        raise ValueError(f"The batch has no element {key!r} (batch type {type(batch).__name__}).") from error


class OutputKeyScorer(PerSampleScorer):
    """Reads per-sample losses the module already returns: ``training_step`` returns a dict with ``key``.

    Free: no extra computation.

    Args:
        key: the entry of ``training_step``'s returned dict holding a ``(B,)`` tensor (or ``(B, ...)``,
            averaged over the non-batch dimensions). ``k*B`` rows (two views' ``(2B,)``, flattened tokens'
            ``(B*T,)``) are refused: their layout is unknown, so reduce them to ``(B,)`` first.
    """

    def __init__(self, key: str = "per_sample_loss") -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"`key`={key!r} must be a non-empty string.")
        self.key = key

    def __call__(self, pl_module: torch.nn.Module, batch: Any, outputs: Any, batch_size: int) -> Tensor:
        if not isinstance(outputs, dict) or self.key not in outputs:
            found = sorted(outputs) if isinstance(outputs, dict) else type(outputs).__name__
            raise ValueError(
                f"OutputKeyScorer: training_step's output has no {self.key!r} entry (found {found})."
            )
        losses = torch.as_tensor(outputs[self.key]).detach()
        rows = rows_per_sample(losses, batch_size)
        if rows is not None and losses.shape[0] != batch_size:
            # k*B rows have no known layout: [view1; view2] stacked (SimCLR) puts a sample's rows apart, a
            # (B*T,) flattening keeps them together; folding them into runs of k would misattribute the first
            count = losses.shape[0] // batch_size
            raise ValueError(
                f"OutputKeyScorer: outputs[{self.key!r}] has {losses.shape[0]} rows for a batch of "
                f"{batch_size} samples; it must be a ({batch_size},) tensor, one loss per sample. Reduce the "
                f"rows first: `losses.view({count}, {batch_size}).mean(0)` for {count} views stacked view by "
                f"view (SimCLR's [view1; view2]), `losses.view({batch_size}, -1).mean(1)` for rows sample by "
                "sample."
            )
        if rows is None:
            raise ValueError(
                f"OutputKeyScorer: outputs[{self.key!r}] does not split into {batch_size} samples."
            )
        return rows.float().mean(dim=1)


class ForwardLossScorer(PerSampleScorer):
    """Scores with a second, gradient-free forward pass: ``loss(pl_module(batch[input]), batch[target])``.

    Costs about one third of a training step (a forward without backward). The module runs in eval mode
    for it (no dropout, no batch-norm statistics updates), the global RNG state is preserved, and every
    buffer the forward writes all the same is given back (a torch.ao fake quantizer observes in eval mode
    too: its ``min_val``/``max_val``, ``scale`` and ``zero_point`` would move at each scoring;
    :func:`~lightning_pulse.core.carried_state.kept_buffers`), so the training itself is not disturbed.

    Args:
        loss: a ``torch.nn.functional`` loss name (one of :data:`CAPTURED_LOSSES`).
        input: index or key of the model input in the batch.
        target: index or key of the target in the batch.
        flatten_tokens: reshape outputs ``(B, T, V) -> (B*T, V)`` and targets ``(B, T) -> (B*T,)`` first, as
            language models do.
    """

    def __init__(
        self,
        loss: str = "cross_entropy",
        input: int | str = 0,
        target: int | str = 1,
        flatten_tokens: bool = False,
    ) -> None:
        if loss not in CAPTURED_LOSSES:
            close = difflib.get_close_matches(str(loss), CAPTURED_LOSSES, n=1, cutoff=0.6)
            meant = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"`loss`={loss!r} is not one of {list(CAPTURED_LOSSES)}{meant}.")
        self.loss = loss
        self.input = input
        self.target = target
        self.flatten_tokens = flatten_tokens

    def __call__(self, pl_module: torch.nn.Module, batch: Any, outputs: Any, batch_size: int) -> Tensor:
        inputs, targets = _pick(batch, self.input), _pick(batch, self.target)
        modes = {module: module.training for module in pl_module.modules()}
        pl_module.eval()
        try:
            with (
                torch.no_grad(),
                torch.random.fork_rng(devices=[]),
                kept_buffers(pl_module),
            ):
                predictions = pl_module(inputs)
                if self.flatten_tokens:
                    predictions = predictions.reshape(-1, predictions.shape[-1])
                    targets = targets.reshape(-1)
                loss_fn = _INTERCEPTOR.originals.get(self.loss, getattr(F, self.loss))
                unreduced = loss_fn(predictions, targets, reduction="none")
        finally:
            for module, training in modes.items():
                module.train(training)
        per_sample = per_sample_from_unreduced(
            unreduced, batch_size, element_weights(self.loss, {"target": targets}, unreduced)
        )
        if per_sample is None:
            raise ValueError(
                f"ForwardLossScorer: the unreduced {self.loss} has shape {tuple(unreduced.shape)}, which does not "
                f"split into {batch_size} samples."
            )
        return per_sample


class StepLossCaptures:
    """One :class:`LossCapture` per training step, inside one fit-long :func:`loss_capture_scope`.

    :meth:`open` at a batch's start; :meth:`close` before its backward (what runs after, such as a maintain
    probe, is not the step's loss), which keeps the closed capture as :attr:`closed`; :meth:`take` hands it over
    at the batch's end. :meth:`release` closes everything and ends the scope.
    """

    def __init__(self) -> None:
        self.closed: LossCapture | None = None
        self._open: LossCapture | None = None
        self._scope: Any = None
        self._unread_sites: set[tuple[Any, ...]] = set()  # LossCapture.unread_sites, over the fit's steps
        self._row_sources: dict[tuple[Any, ...], Any] = {}  # LossCapture.row_sources, over the fit's steps
        self._serial = 0
        self.maximized = False  # each step's LossCapture.maximized: the optimizers ascend the loss

    def start(self) -> None:
        """Enter the fit-long scope (once)."""
        self._unread_sites, self._row_sources = set(), {}  # a new fit may train another module
        if self._scope is None:
            self._scope = loss_capture_scope()
            self._scope.__enter__()

    def open(
        self,
        batch_size: int,
        sample_weights: Tensor | None = None,
        offered: int | None = None,
        batch: Any = None,
        module: torch.nn.Module | None = None,
    ) -> None:
        """Start capturing this step's per-sample losses (the previous step's capture is dropped); the
        weights, ``offered``, ``batch`` and ``module`` as :class:`LossCapture` takes them."""
        self.drop()
        self._open = LossCapture(
            batch_size=batch_size, sample_weights=sample_weights, offered=offered, batch=batch, module=module
        )
        self._open.unread_sites, self._open.row_sources = self._unread_sites, self._row_sources
        self._open.maximized = self.maximized
        self._serial += 1
        self._open.serial = self._serial
        self._open.__enter__()

    def close(self, before_backward: bool = False) -> None:
        """Close the step's capture; ``before_backward``: right before the step's first backward (Lightning's
        ``on_before_backward``), which alone counts in the records' gradients
        (:meth:`LossCapture.backward_starts`)."""
        capture, self._open = self._open, None
        if capture is not None:
            capture.close()
            self.closed = capture
            if before_backward:
                capture.backward_starts()

    def take(self) -> LossCapture | None:
        """The step's closed capture (``None`` if none was opened), which the next step will not see."""
        self.close()
        capture, self.closed = self.closed, None
        if capture is not None:
            capture.forget_graph()  # the step is recorded and kept for a while; its graph is not needed
        return capture

    def drop(self) -> None:
        """Close and forget the step in flight (a rollback replaces the model it was measured on)."""
        self.close()
        self.closed = None

    def release(self) -> None:
        self.drop()
        if self._scope is not None:
            self._scope.__exit__(None, None, None)
            self._scope = None
