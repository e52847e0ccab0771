"""How many samples and tokens a batch holds, for energy per sample and per token.

* Samples: dimension 0 of the first tensor of rank >= 1 found in the batch (depth first through mappings,
  lists, tuples and dataclasses, in field order); a 0-dim tensor (a per-batch value, such as the token count
  a packing collator puts first) is passed over. A batch with no such tensor counts 1 (EnergyLogger then
  warns once when it holds no tensor at all: its per-sample figure would be wrong).
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
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def count_samples(batch: Any) -> int:
    """Dimension 0 of the first tensor of rank >= 1 in ``batch`` (``(B, ...)`` -> ``B``); 1 if there is none.
    A 0-dim tensor is a per-batch value (the token count packing collators put first), not a sample count:
    counted, it made every batch 1 sample."""
    if type(batch) in (list, tuple) and batch and type(batch[0]) is torch.Tensor and batch[0].dim() > 0:
        return int(batch[0].shape[0])  # the common case, fast
    tensor = next((tensor for tensor in batch_tensors(batch) if tensor.dim() > 0), None)
    return 1 if tensor is None else int(tensor.shape[0])


def count_batch(batch: Any) -> tuple[int, int | torch.Tensor | None]:
    """``(count_samples(batch), count_tokens(batch))``, cheaply for a list or tuple led by a tensor."""
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
    """The first tensor in ``batch``, depth first through mappings, lists, tuples and dataclass instances."""
    return next(batch_tensors(batch), None)


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
