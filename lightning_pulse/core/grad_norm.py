"""One optimizer step's loss and global gradient norm, read with torch ops and one device-to-host transfer.

:func:`grad_norm` is the 2-norm of all gradients together, what ``clip_grad_norm_`` computes (torch's
``get_total_norm``: a fused per-tensor norm per device and dtype, then one norm of the stacked results).
:func:`step_loss_and_grad_norm` adds the step's loss and, under DDP, one all-reduce, and brings both numbers
to the host in one transfer.

Where it is read decides what it means. StabilityGuard reads it in ``on_before_optimizer_step``: after every
micro-batch of an accumulation window has added its gradient, after DDP's gradient all-reduce (every rank
holds the same gradients, hence the same norm) and after Lightning's precision plugin unscaled AMP
gradients, before clipping. Under FSDP or DeepSpeed each rank holds a shard of the gradients: the norm read
here would be the local shard's, not the global one, so StabilityGuard refuses those strategies at setup.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor


def grad_norm(grads: Sequence[Tensor]) -> Tensor | None:
    """The 2-norm of ``grads`` taken together, as a 0-d tensor on the first gradient's device.

    Sparse gradients (``nn.Embedding(sparse=True)``) count through their coalesced values (an uncoalesced
    one may hold an index twice). A NaN or infinite entry gives a non-finite norm. Nothing is synchronised.

    Args:
        grads: the gradients, of any dtypes and devices.

    Returns:
        The norm (``None`` when there are no gradients).
    """
    if not grads:
        return None
    parts = _norm_parts(grads)
    try:
        # mixed dtypes are fine: each norm is taken in its tensor's dtype and stack promotes, as
        # get_total_norm does
        return torch.linalg.vector_norm(torch.stack(parts))
    except RuntimeError:  # per-tensor norms on several devices: brought to the first
        return torch.linalg.vector_norm(torch.stack([part.to(parts[0].device) for part in parts]))


def _norm_parts(grads: Sequence[Tensor]) -> list[Tensor]:
    """Norms whose 2-norm together is that of ``grads``: one per tensor, in one fused call (on an accelerator
    one kernel per device and dtype); the total alone where the fused call refuses the mix of devices. Not a
    check per tensor first: on a CPU step reading every gradient's layout and device costs a fifth of the
    norm, so a sparse gradient (which the fused norm refuses) is found by that refusal."""
    try:
        return list(torch._foreach_norm(grads, 2.0))
    except (
        NotImplementedError
    ):  # a sparse gradient: its coalesced values (an uncoalesced one repeats indices)
        dense = [grad.coalesce().values() if grad.is_sparse else grad for grad in grads]
    except RuntimeError:  # gradients on several devices (a model split over them)
        return [torch.nn.utils.get_total_norm(grads, 2.0)]
    try:
        return list(torch._foreach_norm(dense, 2.0))
    except RuntimeError:
        return [torch.nn.utils.get_total_norm(dense, 2.0)]


def step_loss_and_grad_norm(
    param_groups: Iterable[dict[str, Any]],
    losses: Sequence[Tensor],
    all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
    world_size: int = 1,
) -> tuple[float | None, float | None]:
    """The step's loss and global gradient norm, as Python floats.

    Args:
        param_groups: the optimizer's parameter groups; parameters without a gradient are left out.
        losses: the micro-batch losses of the step (0-d). Lightning divides each by
            ``accumulate_grad_batches``, so their sum is the window's mean loss (for a shorter last window of
            an epoch, that mean times its share of a full window: lower, which a detector of upward spikes
            only reads as a calmer step).
        all_reduce_sum: under DDP, the strategy's sum all-reduce (``trainer.strategy.reduce``): the loss is
            then the mean over ranks, and every rank gets the same two numbers bit for bit.
        world_size: the number of ranks ``all_reduce_sum`` sums over.

    Returns:
        ``(loss, grad_norm)``; ``None`` for a value with nothing to read.
    """
    grads = [grad for group in param_groups for param in group["params"] if (grad := param.grad) is not None]
    if len(losses) == 1:  # no accumulation: the sum of one value is that value (no op where none is needed)
        loss = losses[0].detach() if losses[0].requires_grad else losses[0]
        loss = loss if loss.dtype == torch.float32 else loss.float()
    else:
        loss = torch.stack([value.detach().float() for value in losses]).sum() if losses else None
    if all_reduce_sum is None:
        # the loss and every per-tensor norm in the one device-to-host transfer of the step; the last sum of
        # squares is then a few host flops, not two more ops (on a CPU step of a small model, each op costs
        # about as much as the norms of a layer). On an accelerator this is where the step synchronises, which
        # the decision needs anyway (it must exist before optimizer.step()).
        parts = _norm_parts(grads) if grads else []
        values = parts if loss is None else [loss, *parts]
        if not values:
            return None, None
        try:
            read = torch.stack(values).tolist()  # promotes mixed dtypes
        except RuntimeError:  # values on several devices
            read = torch.stack([_as_fp32_on(value, values[0].device) for value in values]).tolist()
        # hypot: the 2-norm of the per-tensor norms in one C call (a generator of squares costs 5x more)
        return (None if loss is None else read[0]), (
            (math.hypot(*read) if loss is None else math.hypot(*read[1:])) if grads else None
        )
    norm = grad_norm(grads)
    # DDP: one all-reduce of (loss sum, ranks with a loss, norm sum). Every rank holds the same all-reduced
    # gradients, so the summed norm divided by world size is the norm; summing it makes the number the same
    # bit for bit on every rank, and with it every decision.
    device = norm.device if norm is not None else loss.device if loss is not None else torch.device("cpu")
    zero = torch.zeros((), device=device)
    stats = torch.stack(
        [
            zero if loss is None else loss.to(device),
            zero if loss is None else torch.ones((), device=device),
            zero if norm is None else norm.to(device, torch.float32),
        ]
    )
    # the step's one transfer (after the collective): where an accelerator run synchronises
    loss_sum, ranks_with_loss, norm_sum = all_reduce_sum(stats).tolist()
    return (loss_sum / ranks_with_loss if ranks_with_loss else None), (
        norm_sum / world_size if grads else None
    )


def _as_fp32_on(value: Tensor, device: torch.device) -> Tensor:
    """``value.to(device, torch.float32)``, without the call where it would change nothing."""
    if value.dtype == torch.float32 and value.device == device:
        return value
    return value.to(device, torch.float32)
