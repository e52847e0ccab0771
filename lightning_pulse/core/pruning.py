"""Pruning as plain torch: the prune event (:class:`Pruner`): absolute unstructured masks or dependency-aware
channel removal, and the bookkeeping a structural change needs (optimizer state, fitting a fresh module to a
pruned state dict).

Nothing here imports Lightning. :mod:`lightning_pulse.core.prune_schedule` decides *when* to prune and to
what sparsity; this module decides *what* and does it.

* Unstructured: ``torch.nn.utils.prune`` masks. Targets are absolute: a mask is recomputed from scratch for
  the asked sparsity (never multiplied into the old one), and weights pruned earlier are pruned first, so
  masks only ever lose entries (Zhu & Gupta 2017).
* Structured: whole output channels / neurons are removed with torch-pruning's dependency graph (DepGraph,
  Fang et al. 2023), which also shrinks every coupled layer (the next layer's input, batch norms, the
  flattened classifier input). Replaced parameters are reported as a :class:`ParameterRemap`, which moves
  optimizer state (Adam moments, momentum buffers) and any per-parameter tensor onto the new parameters.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
import re
import sys
import time
import types
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import prune
from torch.nn.utils.spectral_norm import SpectralNorm

from lightning_pulse.core import prune_dead_branches, prune_targets, prune_widths, user_hooks
from lightning_pulse.core.carried_state import (
    WEIGHT_HOOKS,
    hook_weight_name,
    kept_buffers,
    kept_carried_state,
    kept_python_state,
)
from lightning_pulse.core.func_transforms import transform_active
from lightning_pulse.core.prune_targets import LayerSelection, call_with
from lightning_pulse.core.selection import take_samples
from lightning_pulse.core.snapshots import optimizers_within
from lightning_pulse.errors import first_names
from lightning_pulse.nn.hyper_connections import HyperConnection

RANKINGS = ("layer", "global")
MODES = ("unstructured", "structured")
DEFAULT_LAYER_TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "HFConv1D")

# Module attributes holding hooks; a copy made for a teacher or a shadow must not carry the live hooks of other
# callbacks (a bound method would drag its callback, and through it the Trainer, into the copy).
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _round_count(share: float, total: int) -> int:
    # half-up, not Python's banker's rounding, so 0.5 of 25 channels is 13 on every platform and in every run
    return int(math.floor(share * total + 0.5))


# ---------------------------------------------------------------------------------------------- layers
def resolve_layer_types(
    layer_types: Sequence[str | type] | None, field: str = "layer_types"
) -> tuple[type, ...]:
    """Turn ``["Linear", "torch.nn.Conv2d", MyLayer]`` into module classes.

    A bare name is looked up in ``torch.nn``; a dotted name is imported; ``"HFConv1D"`` matches Hugging Face's
    ``transformers.pytorch_utils.Conv1D`` without importing ``transformers``.

    Raises:
        ValueError: naming ``field``, for a name that is not a ``torch.nn.Module`` class.
    """
    if layer_types is None:
        return ()
    if isinstance(layer_types, (str, type)):
        layer_types = [layer_types]
    if not isinstance(layer_types, Iterable):
        raise ValueError(
            f"`{field}`={layer_types!r} has type {type(layer_types).__name__}; give a list of layer types, "
            "such as ['Linear', 'Conv2d'], or None."
        )
    layer_types = list(layer_types)  # a list before any truth test: an array's is ambiguous
    if not layer_types:  # would mean every layer, as None does: said, not guessed
        raise ValueError(
            f"`{field}`={layer_types!r} names no layer type; give None to choose every layer with a weight, or "
            "the types to choose, such as ['Linear', 'Conv2d']."
        )
    resolved = []
    for item in layer_types:
        cls: Any = item
        if isinstance(item, str) and item == "HFConv1D":
            cls = prune_targets.HFConv1D
        elif isinstance(item, str):
            module_path, _, name = item.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_path) if module_path else nn, name)
            except (ImportError, AttributeError, ValueError):
                cls = None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(
                f"`{field}` entry {item!r} is not a torch.nn.Module class; give a class, a torch.nn name such "
                "as 'Linear' or 'Conv2d', or a dotted import path such as 'mypackage.layers.MyConv'."
            )
        resolved.append(cls)
    return tuple(resolved)


def select_layers(
    model: nn.Module, layer_types: tuple[type, ...] = (), exclude: str | None = None
) -> dict[str, nn.Module]:
    """The layers of ``model`` to prune, by qualified name (:func:`~lightning_pulse.core.prune_targets.select_targets`:
    of ``layer_types``, not matching ``exclude``, read through their forward, tied weights whole)."""
    return prune_targets.select_targets(model, layer_types, exclude).layers


def count_parameters(model: nn.Module) -> dict[str, int]:
    """``{"params": all parameter elements, "params_nonzero": those not masked or zero}``.

    Masked layers count their dense ``weight_orig``; ``params_nonzero`` counts the effective weights. A
    parameter held by several modules counts once.
    """
    total = nonzero = 0
    seen: set[int] = set()
    for module in model.modules():
        for name, parameter in module._parameters.items():
            if parameter is None or id(parameter) in seen:
                continue
            seen.add(id(parameter))
            total += parameter.numel()
            if name.endswith("_orig") and hasattr(module, name[: -len("_orig")] + "_mask"):
                mask = getattr(module, name[: -len("_orig")] + "_mask")
                nonzero += int(torch.count_nonzero(parameter.detach() * mask))
            else:
                nonzero += int(torch.count_nonzero(parameter.detach()))
    return {"params": total, "params_nonzero": nonzero}


# ---------------------------------------------------------------------------------------------- unstructured
def effective_weight(module: nn.Module) -> torch.Tensor:
    """The weight the layer computes with: ``weight_orig * weight_mask`` when masked, else ``weight``."""
    if hasattr(module, "weight_mask") and "weight_orig" in module._parameters:
        return module.weight_orig.detach() * module.weight_mask
    return module.weight.detach()


def current_mask(module: nn.Module) -> torch.Tensor | None:
    """The layer's weight mask, or ``None`` if it has never been masked."""
    mask = getattr(module, "weight_mask", None)
    return mask if isinstance(mask, torch.Tensor) and "weight_orig" in module._parameters else None


def user_masked_tensors(module: nn.Module) -> list[str]:
    """The names of ``module``'s own tensors behind a ``torch.nn.utils.prune`` reparametrisation (a
    ``<name>_orig`` parameter, a ``<name>_mask`` buffer and a pruning method's forward pre-hook that sets
    ``<name>`` from them), whoever put it there: ``["weight"]``, ``["weight", "bias"]``, or ``[]``."""
    names = []
    for hook in module._forward_pre_hooks.values():
        name = getattr(hook, "_tensor_name", None)
        if (
            isinstance(hook, prune.BasePruningMethod)
            and f"{name}_orig" in module._parameters
            and f"{name}_mask" in module._buffers
            and name not in names
        ):
            names.append(name)
    return names


def unstructured_masks(
    scores: Mapping[str, torch.Tensor],
    sparsity: float,
    ranking: str = "layer",
    previous_masks: Mapping[str, torch.Tensor | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Masks with ``round(sparsity * n)`` zeros, lowest scores first, and every zero of the previous masks.

    Args:
        scores: layer name -> importance of each weight, same shape as the weight.
        sparsity: the absolute target share of zeros, in ``[0, 1]``.
        ranking: ``"layer"`` (each layer reaches ``sparsity``) or ``"global"`` (all layers together do).
        previous_masks: layer name -> its current mask; entries already pruned rank below everything, and
            the new mask is the intersection with it, so a mask never gains back a weight: one that held more
            zeros than the target (a mask another pruner put, a pruned model loaded into a fresh run) keeps
            them all, and the mask has more zeros than the target.

    Returns:
        layer name -> a 0/1 mask of the weight's shape and dtype ``float32``.
    """
    if ranking not in RANKINGS:
        raise ValueError(f"`ranking`={ranking!r} is not one of {list(RANKINGS)}.")
    ranked = {}
    for name, score in scores.items():
        flat = score.detach().float().flatten()
        previous = (previous_masks or {}).get(name)
        if previous is not None:
            flat = flat.masked_fill(previous.flatten().to(flat.device) == 0, -math.inf)
        ranked[name] = flat
    masks = {}
    if ranking == "layer":
        for name, flat in ranked.items():
            mask = torch.ones_like(flat)
            prune_count = _round_count(sparsity, flat.numel())
            if prune_count:
                mask[torch.topk(flat, prune_count, largest=False).indices] = 0.0
            masks[name] = mask.view_as(scores[name])
        return _kept_zeros(masks, previous_masks)
    names = list(ranked)
    everything = torch.cat([ranked[name].cpu() for name in names])
    mask = torch.ones_like(everything)
    prune_count = _round_count(sparsity, everything.numel())
    if prune_count:
        mask[torch.topk(everything, prune_count, largest=False).indices] = 0.0
    for name, chunk in zip(names, torch.split(mask, [ranked[n].numel() for n in names])):
        masks[name] = chunk.to(scores[name].device).view_as(scores[name])
    return _kept_zeros(masks, previous_masks)


def _kept_zeros(
    masks: dict[str, torch.Tensor], previous_masks: Mapping[str, torch.Tensor | None] | None
) -> dict[str, torch.Tensor]:
    """``masks``, each times its previous mask: a target below the zeros a mask holds already (put by another
    pruner, or loaded) un-pruned the rest, so a model pruned to 0.70 went back to the schedule's 0.15."""
    for name, previous in (previous_masks or {}).items():
        if previous is not None and name in masks:
            masks[name] = masks[name] * (previous != 0).to(masks[name])
    return masks


def _move_parameter(module: nn.Module, name: str, position: int) -> None:
    # `prune` re-registers `weight` as `weight_orig` at the END of `_parameters`; putting it back where `weight`
    # was keeps `model.parameters()` in the original order, which is what optimizer checkpoints index by.
    items = list(module._parameters.items())
    entry = next(item for item in items if item[0] == name)
    items.remove(entry)
    items.insert(position, entry)
    module._parameters.clear()
    module._parameters.update(items)


class WriteKeepingMask(prune.CustomFromMask):
    """torch's mask from a given tensor (``prune.custom_from_mask``) that keeps a write to the weight it computes.

    torch's mask hook sets ``layer.weight = weight_orig * weight_mask`` before every forward, so a write to
    ``layer.weight`` (a max-norm constraint ``layer.weight.data = torch.renorm(...)`` after the optimizer
    step, a clamp under ``torch.no_grad()``) was overwritten at the next forward and lost with no word: a
    held-out max-norm constraint of 0.5 ended at a row norm of 0.95. This hook remembers the tensor it set (a
    weak reference, its storage pointer and version counter); when, at its next recompute (the layer's
    forward, :func:`refresh_masked_weights`, an event, folding the mask), that same tensor has another storage
    (a ``.data =`` assignment) or a newer version (an in-place write), the written values go into
    ``weight_orig`` where the mask keeps them, then the weight is recomputed: pruned entries stay zero, and
    the write holds as on an unpruned layer. Cost: a handful of Python operations per masked layer and
    recompute, no pass over the weights unless one was written.

    Not seen: an in-place write through ``.data`` (``layer.weight.data.clamp_(...)``: ``.data`` has a version
    counter of its own), a write made between the backward and the optimizer step (it is carried over that
    step's update), and writes inside a ``torch.compile``'d forward (the compiled hook recomputes as torch's
    does) or inside a ``torch.func`` transform (:meth:`_set_inside_transform`). A pending write is dropped
    when a state dict is loaded into the layer (``load_state_dict``, also through :func:`fit_to_state_dict`)
    or a rollback restores it (:func:`discard_written_weights`): the loaded state supersedes it.
    """

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__(mask)
        self._written_check: tuple[weakref.ref, int, int] | None = None

    def __call__(self, module: nn.Module, inputs: Any) -> None:
        if torch.compiler.is_compiling():  # a weak reference and a storage pointer have no place in a graph
            setattr(module, self._tensor_name, self.apply_mask(module))
            return
        if transform_active():
            self._set_inside_transform(module)
            return
        self.keep_written(module)
        weight = self.apply_mask(module)
        setattr(module, self._tensor_name, weight)
        self.remember(weight)

    def _set_inside_transform(self, module: nn.Module) -> None:
        """The layer's weight for a call inside a ``torch.func`` transform (``vmap(jacrev(net))``,
        ``vmap(grad(...))`` with ``functional_call``): ``weight_orig`` as the transform sees it (wrapped, or
        the tensor ``functional_call`` swapped in) times the mask, so the pruned entries are zero in what the
        transform computes. Such a weight has no storage to compare (``data_ptr()`` raises) and
        ``weight_orig`` may not be written inside the transform, so no write is kept or remembered here; the
        weight set outside the transform is put back when the call ends, so ``layer.weight`` never holds a
        tensor of a finished transform and a write to it is kept at the next recompute outside one."""
        name = self._tensor_name
        outside = module.__dict__.get(name)
        setattr(module, name, self.apply_mask(module))
        if outside is None:
            return
        handle: Any = None

        def put_back(layer: nn.Module, args: Any, output: Any) -> None:
            handle.remove()
            setattr(layer, name, outside)

        handle = module.register_forward_hook(put_back, always_call=True)

    def remember(self, weight: torch.Tensor) -> None:
        """Take ``weight``, just set as the layer's computed weight, as the tensor a later write is seen in
        (not one computed under ``torch.inference_mode``, which keeps no version counter: not written to)."""
        inference = weight.is_inference()
        self._written_check = None if inference else (weakref.ref(weight), weight.data_ptr(), weight._version)

    def forget_written(self) -> None:
        """Drop a write not yet kept (a load or a rollback restores the weights it was written over)."""
        self._written_check = None

    def keep_written(self, module: nn.Module) -> bool:
        """Carry a write to the computed weight since it was set into ``weight_orig`` (where the mask keeps
        entries); whether there was one."""
        if self._written_check is None:
            return False
        reference, pointer, version = self._written_check
        weight = module.__dict__.get(self._tensor_name)
        if weight is None or reference() is not weight:  # replaced since (a copy, a fold): not a write to it
            return False
        if weight.data_ptr() == pointer and weight._version == version:
            return False
        original = module._parameters[self._tensor_name + "_orig"]
        mask = module._buffers[self._tensor_name + "_mask"]
        with torch.no_grad():
            original.copy_(torch.where(mask != 0, weight.detach().to(original), original))
        self._written_check = None
        return True

    def remove(self, module: nn.Module) -> None:
        self.keep_written(module)  # folding computes the weight from `weight_orig` again
        super().remove(module)
        # a folded layer is plain torch again: no hook of ours is left to pickle with it
        for key in _forget_pending_write_hooks(module):
            del module._load_state_dict_pre_hooks[key]

    def __getstate__(self) -> dict[str, Any]:  # a weak reference neither pickles nor belongs to a copy
        return {**self.__dict__, "_written_check": None}


def _forget_pending_write(module: nn.Module, *args: Any) -> None:
    """A masked layer's ``load_state_dict`` pre-hook: the loaded weights supersede a write to its computed weight
    not yet kept (a plain ``load_state_dict``, as an EMA or best-weights callback does). It holds no mask."""
    hook = mask_hook(module)
    if isinstance(hook, WriteKeepingMask):
        hook.forget_written()


def _forget_pending_write_hooks(module: nn.Module) -> list[int]:
    return [
        key
        for key, wrapped in module._load_state_dict_pre_hooks.items()
        if getattr(wrapped, "hook", None) is _forget_pending_write
    ]


def mask_hook(module: nn.Module) -> prune.BasePruningMethod | None:
    """The ``torch.nn.utils.prune`` hook that computes ``module.weight``, or ``None``."""
    return next(
        (
            hook
            for hook in module._forward_pre_hooks.values()
            if isinstance(hook, prune.BasePruningMethod) and hook._tensor_name == "weight"
        ),
        None,
    )


def keep_written_weights(layers: Iterable[nn.Module]) -> None:
    """Carry each write to a masked layer's computed weight into ``weight_orig`` now
    (:meth:`WriteKeepingMask.keep_written`): before an event scores the weights."""
    for layer in layers:
        hook = mask_hook(layer)
        if isinstance(hook, WriteKeepingMask):
            hook.keep_written(layer)


def discard_written_weights(model: nn.Module) -> None:
    """Drop the writes to masked layers' computed weights not yet kept (:meth:`WriteKeepingMask.forget_written`):
    a load or a rollback restored the weights they were written over. A pass over the modules."""
    for _, hook in masked_weights(model):
        if isinstance(hook, WriteKeepingMask):
            hook.forget_written()


def add_mask(module: nn.Module, mask: torch.Tensor | None = None) -> None:
    """Put ``module.weight`` behind a mask (all ones by default, a :class:`WriteKeepingMask`), keeping the
    parameter's position."""
    if current_mask(module) is not None:
        return
    position = list(module._parameters).index("weight")
    weight = module.weight
    if mask is None:
        mask = torch.ones_like(weight)
    hook = WriteKeepingMask.apply(module, "weight", mask.to(device=weight.device, dtype=weight.dtype))
    hook.remember(module.weight)
    if not _forget_pending_write_hooks(module):  # once a layer, however often it is masked again
        module.register_load_state_dict_pre_hook(_forget_pending_write)  # a load supersedes a pending write
    _move_parameter(module, "weight_orig", position)


def mask_folded_zeros(layers: Mapping[str, nn.Module], mode: str, sparsity: float) -> list[str]:
    """Put the zeros of each maskless layer back behind a mask, when an unstructured schedule already pruned
    (``sparsity > 0``): a run resumed from a checkpoint saved after fit, whose masks were folded into the
    weights, would otherwise let the pruned weights grow back while the schedule, finished, prunes no more.
    Returns the names of the layers masked again."""
    if mode != "unstructured" or sparsity <= 0:
        return []
    masked = []
    for name, module in layers.items():
        if current_mask(module) is None and not bool(module.weight.all()):
            mask_zeros(module)
            masked.append(name)
    return masked


def mask_zeros(module: nn.Module) -> None:
    """Set the mask of ``module`` to the nonzero entries of its weight (``weight_orig`` behind a mask; a mask
    is added where there is none): weights pruned where no mask says so (folded into the weights) stay
    pruned."""
    mask = current_mask(module)
    if mask is None:
        add_mask(module, module.weight.detach() != 0)
    else:
        mask.copy_(module.weight_orig.detach() != 0)


def masked_layer_names(model: nn.Module) -> list[str]:
    """The qualified names of the modules of ``model`` whose weight is behind a ``torch.nn.utils.prune``
    mask, whoever put it there. A pass over the modules."""
    return [name for name, module in model.named_modules() if current_mask(module) is not None]


def apply_masks(layers: Mapping[str, nn.Module], masks: Mapping[str, torch.Tensor]) -> None:
    """Set each layer's mask to ``masks[name]``, replacing (not multiplying) any mask it had."""
    for name, mask in masks.items():
        module = layers[name]
        existing = current_mask(module)
        if existing is None:
            add_mask(module, mask)
        else:
            existing.copy_(mask.to(existing))
            # what the forward pre-hook would compute at the next call; set now so reports see it
            with torch.no_grad():
                _recompute(module)


def current_parameter_name(name: str, names: Collection[str]) -> str:
    """``name``, a parameter's qualified name read before a mask was added or folded, as it is among ``names``
    now: a mask renames ``X.weight`` to ``X.weight_orig``, and folding it renames it back. Unchanged when
    neither form is among them."""
    if name in names:
        return name
    if f"{name}_orig" in names:
        return f"{name}_orig"
    if name.endswith("_orig") and name[: -len("_orig")] in names:
        return name[: -len("_orig")]
    return name


def finetuning_state_renamed(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A BaseFinetuning state whose optimizer groups name each parameter as the module names it now
    (:func:`current_parameter_name`)."""
    metadata = state.get("internal_optimizer_metadata")
    if not isinstance(metadata, dict):  # an older layout (before Lightning PR #11887): left as it is
        return state
    renamed = {
        index: [
            {**group, "params": [current_parameter_name(name, names) for name in group["params"]]}
            for group in groups
        ]
        for index, groups in metadata.items()
    }
    return {**state, "internal_optimizer_metadata": renamed}


def rename_in_finetuning_states(states: dict[str, Any], keys: Collection[str], model: nn.Module) -> None:
    """Replace, in a checkpoint's callback ``states``, the state of each BaseFinetuning callback (``keys``:
    their state keys) by :func:`finetuning_state_renamed` with the parameter names of ``model`` now. Run once
    the module is restored and before any callback reads its state: BaseFinetuning (BackboneFinetuning) keeps
    the optimizer's groups by parameter name, stored when it set them up, and a mask renamed ``X.weight`` to
    ``X.weight_orig`` since (folding it renames it back): its ``on_fit_start`` then failed on the old name
    (``KeyError``), so no checkpoint after the first event could be resumed."""
    names = {name for name, _ in model.named_parameters()}
    for key in keys:
        state = states.get(key)
        if isinstance(state, dict):
            states[key] = finetuning_state_renamed(state, names)


def make_masks_permanent(
    model: nn.Module,
    keep: Collection[str] = (),
    only: Collection[str] | None = None,
    tensors: Collection[str] | None = None,
) -> list[str]:
    """Fold every ``torch.nn.utils.prune`` mask into its weight, except those of the layers named in ``keep``
    and, with ``only``, of the layers not named in it (another pruner's) and, with ``tensors``, those of the
    parameters not named in it (another pruner's ``bias_mask`` on a layer both prune); returns the names of
    the layers folded."""
    folded = []
    for name, module in model.named_modules():
        if name in keep or (only is not None and name not in only):
            continue
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, prune.BasePruningMethod) and (
                tensors is None or hook._tensor_name in tensors
            ):
                tensor_name = hook._tensor_name
                position = list(module._parameters).index(tensor_name + "_orig")
                prune.remove(module, tensor_name)
                _move_parameter(module, tensor_name, position)
                folded.append(name)
    return folded


MaskedWeight = tuple[nn.Module, prune.BasePruningMethod]


def masked_weights(model: nn.Module) -> list[MaskedWeight]:
    """Every ``(layer, mask hook)`` of ``model`` whose weight a ``torch.nn.utils.prune`` mask computes."""
    return [
        (module, hook)
        for module in model.modules()
        for hook in module._forward_pre_hooks.values()
        if isinstance(hook, prune.BasePruningMethod)
    ]


def _recompute(module: nn.Module) -> None:
    hook = mask_hook(module)
    if hook is not None:
        hook(module, ())
    else:
        module.weight = module.weight_orig * module.weight_mask


def refresh_masked_weights(masked: Sequence[MaskedWeight], grad: bool) -> None:
    """Recompute each masked layer's weight (``weight_orig * weight_mask``) now, with a graph if ``grad``."""
    with torch.set_grad_enabled(grad):
        for module, hook in masked:
            hook(module, ())  # a WriteKeepingMask keeps a write to the weight first


class MaskedWeightRefresh:
    """Keeps ``layer.weight`` of every masked layer current outside the layer's own call.

    torch's mask hook computes ``weight`` in the layer's forward pre-hook only, so between an optimizer step
    and the layer's next call ``layer.weight`` is the previous step's tensor: a read before the call (an L2
    penalty on one layer, a max-norm constraint, a statistic) got last step's values and, with autograd, a
    graph the last backward had freed ("Trying to backward through the graph a second time"). :meth:`refresh`
    at the start of every training batch (``grad=True``: the read joins this step's graph and its gradient
    reaches ``weight_orig`` through the mask) and of every evaluation (``grad=False``) fixes that; the layer's
    own call still recomputes the weight. Cost: one elementwise multiply per masked layer per call.

    Args:
        enabled: ``False`` (structured pruning keeps no masks): :meth:`refresh` does nothing.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._masked: list[MaskedWeight] | None = None

    def refresh(self, model: nn.Module, grad: bool) -> None:
        """Recompute the masked weights of ``model`` (the layers found once, until :meth:`forget`)."""
        if self.enabled:
            if self._masked is None:
                self._masked = masked_weights(model)
            refresh_masked_weights(self._masked, grad)

    def forget(self) -> None:
        """The masked layers may have changed (an event, a restore, masks folded): find them again."""
        self._masked = None

    def __getstate__(self) -> dict[str, Any]:  # pickled for spawning strategies: without the layers
        return {"enabled": self.enabled, "_masked": None}


def layer_sparsity(layers: Mapping[str, nn.Module]) -> dict[str, float]:
    """Share of zero effective weights per layer."""
    return {
        name: 1.0 - float(torch.count_nonzero(effective_weight(m))) / effective_weight(m).numel()
        for name, m in layers.items()
    }


def global_sparsity(layers: Mapping[str, nn.Module]) -> float:
    """Share of zero effective weights over all ``layers`` together."""
    total = sum(effective_weight(m).numel() for m in layers.values())
    zeros = sum(
        effective_weight(m).numel() - int(torch.count_nonzero(effective_weight(m))) for m in layers.values()
    )
    return zeros / total if total else 0.0


# ---------------------------------------------------------------------------------------------- copies
def copy_without_hooks(module: nn.Module, keep_user_hooks: bool = False) -> nn.Module:
    """A deep copy of ``module`` that carries none of its hooks, except those that compute a layer's weight:
    ``torch.nn.utils.prune`` masks and the older ``weight_norm`` / ``spectral_norm``; and, with
    ``keep_user_hooks``, the forward hooks the model's author registered
    (:func:`~lightning_pulse.core.user_hooks.is_user_hook`), which the model's function may depend on (a
    pre-hook gating a layer's inputs): a check of what a cut does must run them as the run will.

    Hooks registered by others (callbacks, profilers) are shared, not copied, during the copy (a bound method
    would otherwise pull its owner, and often the whole Trainer, into the copy) and then dropped from it. A
    kept hook is shared too; one bound to a module of ``module`` is bound to that module's copy.
    """
    memo: dict[int, Any] = {}
    kept: set[int] = set()  # ids of the kept forward hooks' handles
    for submodule in module.modules():
        for attribute in _HOOK_DICTS:
            hooks = getattr(submodule, attribute, None)
            if isinstance(hooks, dict):
                for key, hook in hooks.items():
                    if callable(hook) and not isinstance(hook, WEIGHT_HOOKS):
                        memo[id(hook)] = hook
                    forward = attribute in user_hooks.FORWARD_HOOK_DICTS
                    if keep_user_hooks and forward and user_hooks.is_user_hook(hook):
                        kept.add(key)
        for hook in submodule._forward_pre_hooks.values():
            if isinstance(hook, WEIGHT_HOOKS):
                # the computed weight is recomputed by every forward, usually with a graph attached, and a
                # non-leaf tensor cannot be deep-copied; the copy recomputes it below
                derived = submodule.__dict__.get(hook_weight_name(hook))
                if isinstance(derived, torch.Tensor):
                    memo[id(derived)] = None
        # tensors a hook kept on the model (activations recorded for a loss) still hold their graph after a
        # forward, and a non-leaf tensor cannot be deep-copied: the copy holds them detached
        for value in vars(submodule).values():
            if isinstance(value, (torch.Tensor, list, tuple, dict)):
                for tensor in _nested_tensors(value):
                    if tensor.grad_fn is not None:
                        memo.setdefault(id(tensor), tensor.detach())
    duplicate = copy.deepcopy(module, memo)
    kept_flags = {flag for flags in user_hooks.FORWARD_HOOK_DICTS.values() for flag in flags}
    for submodule in duplicate.modules():
        for attribute in _HOOK_DICTS:
            hooks = getattr(submodule, attribute, None)
            if isinstance(hooks, dict):
                may_keep = attribute in user_hooks.FORWARD_HOOK_DICTS or attribute in kept_flags
                for key, hook in list(hooks.items()):
                    if may_keep and key in kept:
                        hooks[key] = _bound_to_copy(hook, memo)
                    elif not isinstance(hook, WEIGHT_HOOKS):
                        del hooks[key]
        for hook in submodule._forward_pre_hooks.values():
            if isinstance(hook, WEIGHT_HOOKS):
                with torch.no_grad():
                    setattr(submodule, hook_weight_name(hook), _computed_weight(hook, submodule))
    return duplicate


def _nested_tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _nested_tensors(item, depth + 1)


def _bound_to_copy(hook: Any, memo: Mapping[int, Any]) -> Any:
    # a method of a module that was copied runs on the copy: it reads the copy's (cut) state, as the run's
    # hook will read the model's
    owner = getattr(hook, "__self__", None)
    if isinstance(hook, types.MethodType) and isinstance(owner, nn.Module) and id(owner) in memo:
        return types.MethodType(hook.__func__, memo[id(owner)])
    return hook


def _computed_weight(hook: Any, module: nn.Module) -> torch.Tensor:
    if isinstance(hook, prune.BasePruningMethod):
        return hook.apply_mask(module)
    if isinstance(hook, SpectralNorm):  # no power iteration outside training
        return hook.compute_weight(module, do_power_iteration=False)
    return hook.compute_weight(module)


# ---------------------------------------------------------------------------------------------- structured
def import_torch_pruning() -> Any:
    """``torch_pruning``, or an error that says how to install it."""
    try:
        import torch_pruning
    except ImportError as error:  # pragma: no cover - the dev environment has it
        raise ModuleNotFoundError(
            "Structured pruning needs torch-pruning: `pip install 'lightning-pulse[pruning]'` "
            "(or `pip install torch-pruning`)."
        ) from error
    return torch_pruning


def as_example_inputs(example: Any) -> tuple[Any, ...] | dict[str, Any]:
    """Arguments for the model from an example input: keyword arguments for a mapping, else positional ones
    (a tensor or a tuple/list of them)."""
    if isinstance(example, Mapping):
        return dict(example)
    return tuple(example) if isinstance(example, (tuple, list)) else (example,)


@dataclass(frozen=True)
class RunPrecision:
    """How a fit's precision plugin hands a batch to the model, read at setup (:func:`inputs_for`).

    Attributes:
        input_dtype: what the plugin's ``convert_input`` makes of a float32 tensor: float32 under ``32-true``
            and the mixed precisions, which leave batches alone; the run's dtype under the true ones.
        autocast: whether the plugin runs the step under autocast (the mixed precisions).
    """

    input_dtype: torch.dtype
    autocast: bool = False

    @classmethod
    def of_plugin(cls, plugin: Any, autocast: bool) -> RunPrecision:
        """How a Lightning precision ``plugin`` hands a batch over: what its ``convert_input`` makes of a
        float32 tensor, and whether it is a mixed one (``autocast``). The trace input takes the dtype the
        run's batches take, which the module's dtypes do not tell (a float32 stem before a bfloat16 body under
        32-true takes float32 batches); a mixed plugin's autocast, which the trace runs outside of, is why
        half tensors go up to float32 there, and only there."""
        return cls(plugin.convert_input(torch.zeros(())).dtype, autocast=autocast)


def inputs_for(
    model: nn.Module, example: Any, precision: RunPrecision | None = None
) -> tuple[Any, ...] | dict[str, Any]:
    """The arguments (:func:`as_example_inputs`) to call ``model`` with on ``example``: on the model's device,
    with floating tensors converted as the run's ``precision`` plugin converts a batch (known in a fit:
    :attr:`Pruner.run_precision`).

    Under ``bf16-true``, ``16-true`` and ``64-true`` every floating tensor goes to the run's dtype, as those
    plugins' ``convert_input`` does: a float32 ``example_input_array``, which Lightning never converts, is
    traced on the converted model. Under ``32-true`` tensors stay as they are, as that plugin hands a batch
    over: a float64 input stays float64, a float32 one stays float32 for a float32 stem before a bfloat16
    body, and a bfloat16 one stays bfloat16 for a model the user put in bfloat16. Under the mixed precisions
    the same, except that bfloat16 and float16 tensors go up to float32: the trace runs outside their
    autocast, where a float32 layer takes no half tensor. The trace reads the structure only, which the dtype
    does not change.

    Without a run (``precision=None``: a fresh module fitted to a checkpoint, :func:`fit_to_state_dict`,
    :func:`load_pruned`) the run's dtype is guessed as the one holding most of the model's floating parameter
    elements: a true-precision plugin converts the whole module, a model that kept a few parameters apart (a
    float32 scale in a bfloat16 model) still takes its inputs in the converted dtype, and a recorded
    ``bf16-true`` or mixed-precision example meeting a freshly built float32 module goes up to float32."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if precision is None:
        dtype, half_up = _most_elements_dtype(model), True
    else:
        dtype, half_up = precision.input_dtype, precision.autocast

    def move(x: Any) -> Any:
        if isinstance(x, Mapping):  # a dict batch handed whole to `forward(batch)`: its tensors too
            return {key: move(value) for key, value in x.items()}
        if not isinstance(x, torch.Tensor):
            return x
        if dtype is None or not x.is_floating_point():
            return x.to(device)
        if dtype != torch.float32:
            return x.to(device=device, dtype=dtype)
        if half_up and x.dtype in (torch.bfloat16, torch.float16):
            return x.to(device=device, dtype=torch.float32)
        return x.to(device)

    arguments = as_example_inputs(example)
    if isinstance(arguments, dict):
        return {key: move(value) for key, value in arguments.items()}
    return tuple(move(x) for x in arguments)


def _most_elements_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype holding most of ``model``'s floating parameter elements (``None`` without any)."""
    elements: dict[torch.dtype, int] = {}
    for parameter in model.parameters():
        if parameter.is_floating_point():
            size = 0 if nn.parameter.is_lazy(parameter) else parameter.numel()
            elements[parameter.dtype] = elements.get(parameter.dtype, 0) + size
    return max(elements, key=elements.__getitem__) if elements else None


def build_dependency_graph(
    model: nn.Module, example_inputs: Any, precision: RunPrecision | None = None, dead_branches: bool = False
) -> Any:
    """torch-pruning's dependency graph of ``model``, traced with ``model(*args)`` (``model(**kwargs)`` for a
    mapping; :func:`inputs_for` with ``precision``); ``graph.reused_modules`` holds the modules called more
    than once in that forward.

    ``dead_branches``: the outputs of the layers that run but whose outputs the model's output does not reach
    (a WaveNet's discarded last residual) are handed to torch-pruning beside the model's
    (:mod:`~lightning_pulse.core.prune_dead_branches`), so their inputs follow a cut and their outputs are
    never cut; ``graph.dead_branches`` names those layers (``[]`` without the flag, or with none found).

    The tracer switches the model to eval mode and leaves it there; we put every module back in the mode it
    had, since this runs in the middle of training. It follows the autograd graph, so every parameter requires
    grad while it traces (each gets its own flag back after): a layer frozen for the moment (a GradientCache
    freezes its stable prefix in the light phases, when the maintain-phase events come) fed by data that needs
    no grad would leave no autograd node, and torch-pruning would never see it. The layers the user froze are
    kept out of the cuts by :attr:`Pruner.user_frozen`, not by being unseen.
    """
    tp = import_torch_pruning()
    modes = {module: module.training for module in model.modules()}
    inputs = inputs_for(model, example_inputs, precision)
    frozen = [
        parameter
        for parameter in model.parameters()
        if not parameter.requires_grad
        and (parameter.is_floating_point() or parameter.is_complex())
        and not nn.parameter.is_lazy(parameter)
    ]
    try:
        for parameter in frozen:
            parameter.requires_grad_(True)
        # a forward drawing random numbers (ViTMAE's mask) must not move the run's generators at each event
        with _counting_calls(model.modules()) as calls, torch.random.fork_rng(devices=_cuda_devices(model)):
            with torch.enable_grad(), _dead_branches_traced(model, dead_branches) as (forward, dead):
                graph = tp.DependencyGraph().build_dependency(
                    model, example_inputs=inputs, forward_fn=forward, verbose=False
                )
    finally:
        for parameter in frozen:
            parameter.requires_grad_(False)
        for module, training in modes.items():
            module.train(training)
    # only modules with parameters matter: a ReLU module applied twice holds nothing torch-pruning cuts
    graph.reused_modules = {
        m for m, number in calls.items() if number > 1 and any(True for _ in m.parameters())
    }
    graph.dead_branches = list(dead.layers)
    return graph


@contextmanager
def _dead_branches_traced(
    model: nn.Module, traced: bool
) -> Iterator[tuple[Callable[[nn.Module, Any], Any], prune_dead_branches.DeadBranches]]:
    """The forward to trace ``model`` with, and what it found: :func:`call_with` as it is unless ``traced``,
    else one returning the dead branches' outputs beside the model's (:func:`prune_dead_branches.find`)."""
    found = prune_dead_branches.DeadBranches()
    if not traced:
        yield call_with, found
        return
    names = {module: name for name, module in model.named_modules()}
    with prune_dead_branches.recording_outputs(model) as produced:

        def forward(module: nn.Module, example: Any) -> Any:
            produced.clear()
            output = call_with(module, example)
            dead = prune_dead_branches.find(output, produced, names)
            produced.clear()
            found.layers[:] = dead.layers
            return [output, *dead.outputs] if dead.outputs else output

        yield forward, found


def dead_branch_layers(model: nn.Module, example: Any, precision: RunPrecision | None = None) -> list[str]:
    """The names of ``model``'s layers that run on ``example`` but whose outputs its output does not reach
    (:mod:`~lightning_pulse.core.prune_dead_branches`), found by one forward of a copy in eval mode with
    every parameter requiring grad, as a trace runs it; ``[]`` where the copy does not run."""
    duplicate = copy_without_hooks(model, keep_user_hooks=True).eval()
    for parameter in duplicate.parameters():
        if not nn.parameter.is_lazy(parameter) and (parameter.is_floating_point() or parameter.is_complex()):
            parameter.requires_grad_(True)
    names = {module: name for name, module in duplicate.named_modules()}
    try:
        inputs = inputs_for(duplicate, as_traced(example), precision)
        with torch.random.fork_rng(devices=_cuda_devices(duplicate)), torch.enable_grad():
            with prune_dead_branches.recording_outputs(duplicate) as produced:
                output = call_with(duplicate, inputs)
                return prune_dead_branches.find(output, produced, names).layers
    except Exception:  # only the check's second try needs this: the trial cut said why the model is not cut
        return []


@contextmanager
def _counting_calls(modules: Iterable[nn.Module]) -> Iterator[dict[nn.Module, int]]:
    """How many times each of ``modules`` is called inside the block (a forward pre-hook each, removed after).
    A ``torch.jit.script``'ed module refuses hooks: its calls are not counted (its layers are never
    pruned)."""
    calls: dict[nn.Module, int] = {}

    def count(module: nn.Module, args: Any) -> None:
        calls[module] = calls.get(module, 0) + 1

    with prune_targets.hooks_on(modules, lambda module: module.register_forward_pre_hook(count)):
        yield calls


@dataclass
class ChannelGroup:
    """A set of coupled channels that must be removed together, named after its root layer.

    Attributes:
        root: qualified name of the layer whose output channels lead the group.
        module: that layer.
        channels: its current number of output channels.
        group: torch-pruning's group over all channels (used for importance).
        tied: how many of the root's output channels one removal takes (:func:`tied_channels`): 2 for a
            gated layer whose output is split with ``chunk(2)`` into a value and a gate multiplied together.
    """

    root: str
    module: nn.Module
    channels: int
    group: Any
    tied: int = 1


def _touches_output(graph: Any, group: Any) -> bool:
    # A group that prunes the outputs of a node with no consumer changes the model's output (the classifier's
    # logits); such groups are never pruned.
    for dependency, _ in group:
        if not dependency.target.outputs and graph.is_out_channel_pruning_fn(dependency.handler):
            return True
    return False


def _cuts_channels_of(graph: Any, group: Any, modules: Collection[nn.Module]) -> bool:
    # the output channels of one of ``modules`` (a norm's or a depthwise conv's inputs are its outputs: one
    # pruning function for both)
    return any(
        dependency.target.module in modules and graph.is_out_channel_pruning_fn(dependency.handler)
        for dependency, _ in group
    )


def _root_channels(graph: Any, root: nn.Module, indices: Sequence[int]) -> set[int]:
    # the root's own output channels that removing its channels ``indices`` removes
    pruner = graph.get_pruner_of_module(root)
    group = graph.get_pruning_group(root, pruner.prune_out_channels, list(indices))
    return {
        int(index)
        for dependency, dependency_indices in group
        if dependency.target.module is root and graph.is_out_channel_pruning_fn(dependency.handler)
        for index in dependency_indices
    }


def tied_channels(graph: Any, root: nn.Module, channels: int) -> int | None:
    """How many of ``root``'s ``channels`` output channels go with each one torch-pruning removes: 1 for most
    layers; ``k`` when the output is split into ``k`` equal chunks that are combined channel by channel (a
    gated layer: ``a, g = layer(x).chunk(2, dim=-1)``, then ``act(a) * g``), so removing channel ``j`` removes
    ``j``, ``j + channels/k``, ... (a class of ``k``). ``None`` for ties of any other pattern, which cannot be
    counted.
    """
    first = _root_channels(graph, root, [0])
    tied = len(first)
    if tied <= 1:  # none found: a pruning function torch-pruning does not list as cutting outputs, as before
        return 1
    stride = channels // tied
    if channels % tied or first != set(range(0, channels, stride)):
        return None
    # the first `stride` channels must lead disjoint classes that cover every channel
    return tied if _root_channels(graph, root, range(stride)) == set(range(channels)) else None


def channel_groups(
    graph: Any,
    model: nn.Module,
    roots: Mapping[str, nn.Module],
    frozen: Collection[str] = (),
    blocked: dict[str, list[str]] | None = None,
) -> list[ChannelGroup]:
    """Prunable channel groups whose root is one of ``roots``.

    A group is left out when it also removes output channels of a layer that was not chosen (a residual
    coupling with an unchosen layer), when it would change the model's output shape, or when it would cut a
    bare ``nn.Parameter`` (a learned positional table), the width of an ``nn.Embedding`` that is not chosen
    (a language model's residual stream: its every norm, block output and head input), a module called more
    than once per forward, a module holding a shared parameter, a module holding a layer that is not chosen
    (an ``nn.MultiheadAttention``, whose ``out_proj`` is never pruned: cutting it changes its head width), a
    layer whose weight is computed (a parametrization, the older ``weight_norm`` / ``spectral_norm``), or the
    channels of a module named in ``frozen`` (the user's frozen layers, of any type: a norm after the root),
    or of a module holding one, or when the root's own channels are tied in a pattern other than
    :func:`tied_channels` counts. A frozen layer that only reads the cut channels loses those input columns.
    ``blocked``, when given, gets root name -> the modules whose computed weight kept its group from being
    cut.
    """
    root_types = tuple({type(module) for module in roots.values()})
    chosen = set(roots.values())
    unchosen = [m for m in model.modules() if isinstance(m, root_types) and m not in chosen]
    names = {module: name for name, module in model.named_modules()}
    unsafe = set(getattr(graph, "reused_modules", ())) | prune_targets.shared_parameter_modules(model)
    # an embedding table's width is the residual stream's of a transformer: a group through it cuts every
    # norm, block output and the head's inputs, far more than the chosen layers (chosen, it is cut as asked)
    unsafe |= {m for m in model.modules() if isinstance(m, nn.Embedding) and m not in chosen}
    # a module holding a layer that is not chosen (an nn.MultiheadAttention, whose out_proj is never pruned or
    # was excluded by name) is one node to torch-pruning: cutting it would cut that layer too
    left_out = set(unchosen)
    unsafe |= {m for m in model.modules() if m not in left_out and any(c in left_out for c in m.children())}
    # a weight computed from other tensors (a parametrization, the older weight_norm / spectral_norm hooks) is
    # recomputed from its uncut sources at the next forward: such a layer cannot be cut as a consumer either
    computed = {m for m in model.modules() if prune_targets.computes_its_weight(m)}
    unsafe |= computed
    # the user's frozen layers keep their channels: not only those of the chosen types (unchosen above), but a
    # frozen norm or scale that the root's group would cut with it
    named = dict(model.named_modules())
    frozen_modules = {named[name] for name in frozen if name in named}
    holds_frozen = {m for m in model.modules() if any(sub in frozen_modules for sub in m.modules())}
    groups = []
    for group in graph.get_all_groups(ignored_layers=unchosen, root_module_types=root_types):
        root_module = group[0].dep.target.module
        if root_module not in chosen or _touches_output(graph, group):
            continue
        if _cuts_channels_of(graph, group, holds_frozen):
            continue
        targets = [dependency.target.module for dependency, _ in group]
        if any(isinstance(target, nn.Parameter) or target in unsafe for target in targets):
            if blocked is not None and (computing := [names[t] for t in targets if t in computed]):
                blocked[names[root_module]] = list(dict.fromkeys(computing))
            continue
        channels = int(graph.get_pruner_of_module(root_module).get_out_channels(root_module))
        tied = tied_channels(graph, root_module, channels)
        if tied is not None:  # other ties would remove channels no count foresees
            groups.append(ChannelGroup(names[root_module], root_module, channels, group, tied))
    return groups


def channel_importance(groups: Sequence[ChannelGroup], normalize: bool = False) -> dict[str, torch.Tensor]:
    """Importance of each channel of each group, by root name: the group L2 norm (each channel's weights in
    the root layer and in every coupled layer). ``normalize`` divides each group by its mean, so groups can be
    ranked together (global ranking). A group whose channels are tied (:attr:`ChannelGroup.tied`) gets one
    importance per class of tied channels (their mean), in the order of the class's first channel."""
    tp = import_torch_pruning()
    scorer = tp.importance.GroupMagnitudeImportance(p=2, normalizer="mean" if normalize else None)
    result = {}
    for channel_group in groups:
        imp = scorer(channel_group.group)
        if imp is not None:
            result[channel_group.root] = imp.reshape(channel_group.tied, -1).mean(0)
    return result


def channels_to_remove(
    importances: Mapping[str, torch.Tensor],
    original_channels: Mapping[str, int],
    sparsity: float,
    ranking: str = "layer",
    min_channels: int = 1,
    tied: Mapping[str, int] | None = None,
) -> dict[str, list[int]]:
    """Which channels (current indices) to remove so that ``sparsity`` of the ORIGINAL channels are gone.

    ``"layer"``: every group keeps ``round(original * (1 - sparsity))`` channels. ``"global"``: all groups
    together keep ``round(sum(original) * (1 - sparsity))``, the lowest importances across groups going
    first. No group drops below ``min_channels``. ``tied``: root name -> how many channels each removal takes
    (:func:`tied_channels`); such a group's importances are per class of tied channels, an index names a
    class (torch-pruning removes its other channels with it), and it keeps ``round(original / tied *
    (1 - sparsity))`` classes, so the channels removed are those asked for, not ``tied`` times as many.
    """
    if ranking not in RANKINGS:
        raise ValueError(f"`ranking`={ranking!r} is not one of {list(RANKINGS)}.")
    ties = {name: (tied or {}).get(name, 1) for name in importances}
    removals: dict[str, list[int]] = {}
    current = {name: int(imp.numel()) for name, imp in importances.items()}  # classes of tied channels
    if ranking == "layer":
        for name, imp in importances.items():
            least = -(-min_channels // ties[name])
            keep = max(least, _round_count(1.0 - sparsity, original_channels[name] // ties[name]))
            count = current[name] - keep
            if count > 0:
                removals[name] = sorted(torch.argsort(imp.float().cpu(), stable=True)[:count].tolist())
        return removals
    names = list(importances)
    keep_total = _round_count(1.0 - sparsity, sum(original_channels[name] for name in names))
    count = sum(current[name] * ties[name] for name in names) - max(keep_total, min_channels * len(names))
    if count <= 0:
        return removals
    flat = torch.cat([importances[name].float().cpu() for name in names])
    owners = [(name, index) for name in names for index in range(current[name])]
    left = dict(current)
    for position in torch.argsort(flat, stable=True).tolist():
        if count <= 0:
            break
        name, index = owners[position]
        # a class takes `tied` channels: none that would overshoot the count or go below `min_channels`
        if (left[name] - 1) * ties[name] < min_channels or ties[name] > count:
            continue
        removals.setdefault(name, []).append(index)
        left[name] -= 1
        count -= ties[name]
    return {name: sorted(indices) for name, indices in removals.items()}


class ParameterRemap:
    """What a structural change did to parameters: ``old -> (new, kept)``.

    ``kept`` holds the flat indices of ``old`` that survive in ``new`` (``new.flatten() ==
    old.flatten()[kept]``), so any tensor shaped like ``old`` (an Adam moment, a score, a cached gradient)
    can follow with :meth:`apply`. Replacements chained within one event are composed. A cut made in place
    (:func:`prune_group` keeps each parameter object: ``new is old``) records the shape before it, which
    :meth:`shape_before` gives.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[nn.Parameter, nn.Parameter, torch.Tensor]] = {}
        self._key_of_new: dict[int, int] = {}
        self._shapes: dict[int, torch.Size] = {}  # key -> the shape of the first `old`, before this event

    def add(
        self, old: nn.Parameter, new: nn.Parameter, kept: torch.Tensor, old_shape: torch.Size | None = None
    ) -> None:
        key = self._key_of_new.pop(id(old), None)
        if key is not None:  # `old` was itself created earlier in this event: compose the index maps
            first_old, _, first_kept = self._entries[key]
            self._entries[key] = (first_old, new, first_kept[kept])
        else:
            key = id(old)
            self._entries[key] = (old, new, kept)
            self._shapes[key] = old.shape if old_shape is None else old_shape
        self._key_of_new[id(new)] = key

    def shape_before(self, parameter: torch.Tensor) -> torch.Size:
        """The shape ``parameter`` (an ``old`` here) had before the change; its shape when not in it."""
        return self._shapes.get(id(parameter), parameter.shape)

    def __iter__(self) -> Iterator[tuple[nn.Parameter, nn.Parameter, torch.Tensor]]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def new_of(self, old: torch.Tensor) -> nn.Parameter | None:
        entry = self._entries.get(id(old))
        return None if entry is None else entry[1]

    @staticmethod
    def apply(
        tensor: torch.Tensor, old_shape: torch.Size, new_shape: torch.Size, kept: torch.Tensor
    ) -> torch.Tensor:
        """``tensor`` (shaped like the old parameter) cut down to the new parameter's shape."""
        if tensor.shape != old_shape:
            raise ValueError(
                f"Cannot remap a tensor of shape {tuple(tensor.shape)} onto parameter shape {tuple(old_shape)}."
            )
        cut = tensor.reshape(-1).index_select(0, kept.to(tensor.device)).reshape(new_shape)
        return cut.clone(memory_format=prune_widths.memory_format_of(tensor))


def module_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """The torch optimizers ``model`` and its submodules hold in their attributes, or as the items of a list,
    tuple or dict attribute: the optimizer-in-backward recipe keeps one per parameter
    (``self.opts = {p: Adam([p]) for p in ...}``, stepped by ``register_post_accumulate_grad_hook``), which the
    Trainer never sees. A cut must cut their state as the Trainer's optimizers': their Adam moments kept the
    uncut shapes, and the first backward after a cut raised torch's size mismatch inside the hook."""
    found: dict[int, torch.optim.Optimizer] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, dict):
                value = list(value.values())
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, torch.optim.Optimizer):
                    found.setdefault(id(item), item)
    return list(found.values())


def remap_optimizer_state(
    optimizer: torch.optim.Optimizer, remap: ParameterRemap, names: Mapping[int, str] | None = None
) -> list[str]:
    """Swap replaced parameters inside ``optimizer`` and cut their state to the new shapes, in place.

    The optimizer stays the same object, so LR schedulers and Lightning's wrappers that hold it stay valid.
    State tensors shaped like the parameter are cut with the kept indices; scalars (Adam's ``step``) are
    kept. A state of any other shape, or a list or mapping of tensors, cannot be cut and is dropped (the
    optimizer re-creates it lazily). A square ``(n, n)`` weight's state of its shape may instead be a matrix
    over one side (a Shampoo or K-FAC preconditioner): outside ``torch.optim``'s own optimizers, one that
    reads so (:func:`_one_side_matrix`) is dropped too, unless the cut kept the same rows as columns (then
    every reading is cut alike). ``names`` (``id(parameter) -> name``) names the parameters in the messages.
    A parameter that was not replaced keeps its state, unless that holds a
    tensor with as many elements as all the optimizer's parameters had (a flat vector over them, which no
    longer fits): then it is dropped too. ``torch.optim.LBFGS`` keeps its whole history so (under its first
    parameter); once any parameter is replaced, all of it is dropped (:data:`LBFGS_RESET`). The returned
    messages say what was dropped.
    """
    problems: list[str] = []
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    total_before = sum(math.prod(remap.shape_before(parameter)) for parameter in parameters)
    replaced: set[int] = set()  # ids: a set of tensors would compare their values
    for old, new, kept in remap:
        old_shape = remap.shape_before(old)
        for group in optimizer.param_groups:
            for index, parameter in enumerate(group["params"]):
                if parameter is old:
                    group["params"][index] = new
                    replaced.add(id(new))
        if id(new) not in replaced or old not in optimizer.state:
            continue
        state = optimizer.state.pop(old)
        moved: dict[str, Any] | None = {}
        # a square weight's state of its shape may be a matrix over its outputs or inputs, not one value per
        # weight; cut as the weight, it turned wrong (non-symmetric) or took a shape the next step crashed on
        one_sided = (
            len(old_shape) == 2
            and old_shape[0] == old_shape[1]
            and not _keeps_one_value_per_weight(optimizer)
            and not _same_cut_on_both_sides(old_shape, new.shape, kept)
        )
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == old_shape and value.dim() > 0:
                reading = _one_side_matrix(value, new.shape) if one_sided else None
                if reading is not None:
                    moved = None
                    name = (names or {}).get(id(new))
                    problems.append(
                        f"optimizer state {key!r} of {type(optimizer).__name__} for "
                        f"{f'parameter {name!r}' if name else 'a parameter'} of shape {tuple(old_shape)} "
                        f"{reading}, so it reads as a matrix over the weight's outputs or its inputs (a "
                        "Shampoo or K-FAC preconditioner), not one value per weight; the cut kept other rows "
                        "than columns, so which side it covers is unknown and cut as the weight it would be "
                        "wrong; that parameter's state was reset."
                    )
                    break
                moved[key] = ParameterRemap.apply(value, old_shape, new.shape, kept)
            elif any(tensor.numel() > 1 for tensor in prune_targets.tensors_in(value)):
                moved = None
                what = (
                    f"of shape {tuple(value.shape)}"
                    if isinstance(value, torch.Tensor)
                    else f"(a {type(value).__name__} of tensors)"
                )
                problems.append(
                    f"optimizer state {key!r} {what} for a parameter of shape {tuple(old_shape)} cannot be cut "
                    "to the pruned shape; that parameter's state was reset."
                )
                break
            else:
                moved[key] = value
        if moved is not None:
            optimizer.state[new] = moved
    if not replaced:
        return problems
    if isinstance(optimizer, torch.optim.LBFGS):
        optimizer.state.clear()
        optimizer._numel_cache = None  # LBFGS caches its parameters' total size; the cut changed it
        return [LBFGS_RESET]
    for parameter in [p for p in optimizer.state if id(p) not in replaced]:
        flat = [
            key
            for key, value in optimizer.state[parameter].items()
            if any(t.numel() == total_before != parameter.numel() for t in prune_targets.tensors_in(value))
        ]
        if flat:
            del optimizer.state[parameter]
            problems.append(
                f"optimizer state {flat[0]!r} of a parameter of shape {tuple(parameter.shape)} holds a tensor of "
                f"{total_before} elements, as many as all the optimizer's parameters had before the cut (a flat "
                "vector over them), which no longer fits; that parameter's state was reset."
            )
    return problems


#: what a structured cut does to a ``torch.optim.LBFGS`` (:func:`remap_optimizer_state`)
LBFGS_RESET = (
    "torch.optim.LBFGS's history (its search direction, last gradient and curvature pairs: flat vectors over "
    "all its parameters) does not fit the cut parameters and was reset; its next step starts a fresh history, "
    "as its first step did."
)


def _keeps_one_value_per_weight(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of ``torch.optim``'s own, whose every state shaped like its parameter
    holds one value per weight (Adam's moments, SGD's momentum, Adagrad's sum, ASGD's ``ax``, ...); a
    subclass or another library's optimizer may keep other matrices of that shape."""
    return type(optimizer).__module__.split(".")[:2] == ["torch", "optim"]


def _same_cut_on_both_sides(old_shape: torch.Size, new_shape: torch.Size, kept: torch.Tensor) -> bool:
    """Whether the cut of a square ``(n, n)`` weight kept the same rows as columns, in the same order (a
    residual stream cut on both sides): then one value per weight, a matrix over the outputs ``(n, n)`` and
    one over the inputs ``(n, n)`` are all cut to the same elements."""
    n = old_shape[0]
    if len(new_shape) != 2 or new_shape[0] != new_shape[1] or kept.numel() != math.prod(new_shape):
        return False
    grid = kept.reshape(new_shape)
    rows, columns = grid[:, 0] // n, grid[0, :] % n
    return torch.equal(rows, columns) and torch.equal(grid, rows[:, None] * n + columns[None, :])


def _one_side_matrix(value: torch.Tensor, new_shape: torch.Size) -> str | None:
    """Why ``value``, a state of a square weight's shape ``(n, n)``, reads as a matrix over one side of the
    weight rather than one value per weight; ``None`` when it reads as one value per weight.

    A preconditioner over one side (Shampoo's ``L``/``R``, K-FAC's factors) is symmetric; an eigenbasis over
    one side (SOAP's) has orthonormal rows and columns. A momentum or second moment of a trained weight is
    neither. An all-zero one is cut alike under both readings, unless the cut leaves the weight non-square:
    then the readings want different shapes.
    """
    if not value.is_floating_point():
        return None
    matrix = value.detach().float()
    scale = float(matrix.abs().max())
    if scale == 0.0:
        square = new_shape[0] == new_shape[1]
        return None if square else "is all zero while the cut leaves the weight non-square"
    tolerance = max(1e-4, 8 * torch.finfo(value.dtype).eps)
    if float((matrix - matrix.T).abs().max()) <= tolerance * scale:
        return "is symmetric"
    norms = torch.cat([matrix.square().sum(0), matrix.square().sum(1)])
    if float((norms - 1).abs().max()) <= tolerance:  # a weight's copy drawn at 1/sqrt(n) scale is farther
        return "has orthonormal rows and columns"
    return None


def _index_shadow(module: nn.Module) -> nn.Module:
    # A copy of the layer whose every parameter holds its own flat indices (float64: exact up to 2**53
    # elements). Running torch-pruning's handler on it tells which elements the real handler keeps, whatever
    # the layer type and pruned dimension.
    shadow = copy_without_hooks(module)
    for submodule in shadow.modules():
        for name, parameter in list(submodule._parameters.items()):
            if parameter is not None:
                encoding = torch.arange(parameter.numel(), dtype=torch.float64, device=parameter.device)
                submodule._parameters[name] = nn.Parameter(
                    encoding.view(parameter.shape), requires_grad=False
                )
    return shadow


def _named_parameters_of(module: nn.Module) -> dict[tuple[nn.Module, str], nn.Parameter]:
    return {
        (submodule, name): parameter
        for submodule in module.modules()
        for name, parameter in submodule._parameters.items()
        if parameter is not None
    }


def prune_group(
    graph: Any, model: nn.Module, root: nn.Module, indices: Sequence[int], remap: ParameterRemap
) -> None:
    """Remove output channels ``indices`` of ``root`` and everything coupled to them; record replacements."""
    pruner = graph.get_pruner_of_module(root)
    group = graph.get_pruning_group(root, pruner.prune_out_channels, list(indices))
    if not graph.check_pruning_group(group):
        raise ValueError(f"Removing {len(indices)} channels from {root} would leave a layer with no channel.")
    real_modules = set(model.modules())
    targets = []
    for dependency, _ in group:
        module = dependency.target.module
        if isinstance(module, nn.Parameter):
            raise NotImplementedError("Channel groups that cut a bare nn.Parameter are not supported.")
        if module in real_modules and module not in targets:
            targets.append(module)
    shadows = {module: _index_shadow(module) for module in targets}
    before = {module: _named_parameters_of(module) for module in targets}
    for dependency, dependency_indices in group:
        module = dependency.target.module
        if module in shadows:
            dependency.handler.__self__.pruning_dim = dependency.target.pruning_dim
            dependency.handler(shadows[module], list(dependency_indices))
    group.prune()
    cut: set[int] = set()  # ids of the parameters already cut in place (a tied one is met twice)
    for module in targets:
        paths = {submodule: path for path, submodule in module.named_modules()}
        shadow_modules = dict(shadows[module].named_modules())
        for (owner, name), old in before[module].items():
            new = owner._parameters[name]
            if new is old:
                continue
            owner._parameters[name] = old  # the same object, cut: see cut_in_place
            if id(old) in cut:
                continue
            cut.add(id(old))
            kept = shadow_modules[paths[owner]]._parameters[name].detach().reshape(-1).long()
            old_shape = old.shape
            cut_in_place(old, new, kept)
            remap.add(old, old, kept, old_shape)


@torch.no_grad()
def cut_in_place(parameter: nn.Parameter, cut: torch.Tensor, kept: torch.Tensor | None) -> None:
    """Give ``parameter`` the values of ``cut`` (its elements ``kept``), keeping the object.

    torch-pruning puts new parameters into the layers; the old objects are what the user's hooks
    (``register_post_accumulate_grad_hook``, ``register_hook``), the user's own lists of parameters, every
    optimizer (a wrapper's inner one too) and DDP hold, so the cut goes back into them: all stay valid. A
    gradient is cut with the same indices (a shape that no longer fits the parameter could not be kept).
    """
    grad, parameter.grad = parameter.grad, None
    layout = prune_widths.memory_format_of(parameter)
    prune_widths.drop_gradient_accumulator(parameter)
    parameter.data = cut.detach().contiguous(memory_format=layout)
    if grad is not None and kept is not None:
        parameter.grad = ParameterRemap.apply(grad, grad.shape, cut.shape, kept)


@dataclass
class StructuredResult:
    """Outcome of one structured pruning call.

    Attributes:
        removed: root name -> number of channels removed now.
        history: torch-pruning's history entries ``[root name, is_out_channel, indices]`` of this call, in
            order; replaying all calls' entries on a fresh module reproduces the pruned shapes.
        remap: the parameters replaced.
        roots: the roots whose channel group could be cut in this call (whether or not it was).
        blocked: root name -> the modules whose computed weight kept its group from being cut
            (:func:`channel_groups`).
        untraced: the chosen layers the trace did not reach from the output (called depending on the data,
            as an expert behind a router, or their output unused): no group of theirs was seen to cut.
    """

    removed: dict[str, int]
    history: list[list[Any]]
    remap: ParameterRemap
    roots: set[str] = field(default_factory=set)
    blocked: dict[str, list[str]] = field(default_factory=dict)
    untraced: set[str] = field(default_factory=set)


@contextmanager
def kept_through_trace(model: nn.Module) -> Iterator[None]:
    """Give back what a trace of the live ``model`` (:func:`build_dependency_graph`) left in it: its buffers,
    the tensors it carries as plain attributes and its public numbers, lists and dicts, as the fit-start check
    gives back what its trace wrote (:func:`~lightning_pulse.core.prune_setup.structured_example`). The trace
    runs the user's hooks and the model's forward on two samples: a hook counting calls in a buffer counted one
    more per event, and a forward keeping its output (``self.h = out.detach()``) would carry the trace's."""
    with kept_python_state(model), kept_carried_state(model), kept_buffers(model):
        yield


def prune_channels(
    model: nn.Module,
    example_inputs: Any,
    layers: Mapping[str, nn.Module],
    sparsity: float,
    original_channels: dict[str, int],
    ranking: str = "layer",
    min_channels: int = 1,
    precision: RunPrecision | None = None,
    frozen: Collection[str] = (),
    dead_branches: bool = False,
) -> StructuredResult:
    """Physically remove channels so that ``sparsity`` of the original channels of ``layers`` are gone.

    ``original_channels`` maps root names to their channel count before any pruning; groups seen for the
    first time are added to it (so pass the same dict on every call). ``precision``: see :func:`inputs_for`.
    ``frozen``: names of the layers the user froze; no group that would cut one of them is cut.
    ``dead_branches``: trace the layers whose outputs the forward discards too
    (:func:`build_dependency_graph`).
    """
    with kept_through_trace(model):  # the live model: the cut comes after, on what the fit had
        graph = build_dependency_graph(model, example_inputs, precision, dead_branches)
    blocked: dict[str, list[str]] = {}
    groups = channel_groups(graph, model, layers, frozen, blocked)
    for channel_group in groups:
        original_channels.setdefault(channel_group.root, channel_group.channels)
    importances = channel_importance(groups, normalize=ranking == "global")
    tied = {channel_group.root: channel_group.tied for channel_group in groups}
    removals = channels_to_remove(importances, original_channels, sparsity, ranking, min_channels, tied)
    remap = ParameterRemap()
    roots = {channel_group.root: channel_group.module for channel_group in groups}
    for root_name, indices in removals.items():
        prune_group(graph, model, roots[root_name], indices, remap)
    history = [
        [str(name), bool(is_out), [int(i) for i in idxs]] for name, is_out, idxs in graph.pruning_history()
    ]
    removed = {name: len(indices) * tied[name] for name, indices in removals.items()}
    untraced = {name for name, module in layers.items() if module not in graph.module2node}
    return StructuredResult(removed, history, remap, {group.root for group in groups}, blocked, untraced)


def replay_structure(
    model: nn.Module,
    example_inputs: Any,
    history: Sequence[Sequence[Any]],
    precision: RunPrecision | None = None,
    events: Sequence[int] | None = None,
    dead_branches: bool = False,
) -> str | None:
    """Re-apply recorded structured pruning to a freshly built ``model``, so a pruned state dict fits it
    (``precision``: see :func:`inputs_for`). ``events``: how many of the ``history`` entries each event cut
    (:attr:`Pruner.history_events`; ``None``: all as one event, as recorded before it was kept).
    ``dead_branches``: traced as the run traced them (:attr:`Pruner.trace_dead_branches`).

    Each event's entries are replayed on a graph traced anew, as the fit traced one per event: the indices
    of a gated layer's ``chunk(2)`` split in a graph are those of the widths it was traced at, so entries of
    a later event replayed on the first event's graph paired other channels (a WaveNet's checkpoint saved
    after several events lost 21 of a layer's 32 channels instead of 16). Returns why the replay stopped, or ``None``:
    a recorded root the trace did not reach (a mixture-of-experts router sends the recorded input to other
    experts in a fresh module than in the run), with the events before it replayed."""
    named = dict(model.named_modules())
    for entries in _history_by_event(history, events):
        held = {
            (id(module), name): param
            for module in model.modules()
            for name, param in module._parameters.items()
        }
        try:
            with kept_through_trace(model):  # a resume replays on the live module
                graph = build_dependency_graph(model, example_inputs, precision, dead_branches)
            untraced = [name for name, _, _ in entries if named.get(name) not in graph.module2node]
            if untraced:
                return (
                    f"the recorded input, traced through this module, does not reach {_some(untraced)}, which "
                    "the run cut (a layer called depending on the data, as an expert behind a router)"
                )
            graph.load_pruning_history([[name, is_out, list(indices)] for name, is_out, indices in entries])
        except Exception as error:  # a trace or cut this module cannot follow: the saved shapes decide
            # (a checkpoint resumed from one saved before events were told apart: its first, merged, event
            # replayed on one graph gives other widths, and the next event's trace fails in the model's forward)
            return f"an event's replay failed ({type(error).__name__}: {error})"
        finally:
            # torch-pruning put new parameters in: the objects the module's hooks and lists hold take their
            # values, as at a cut (a resume or load_pruned left a user's gradient hooks and lists of parameters
            # dead)
            for module in model.modules():
                for name, new in list(module._parameters.items()):
                    old = held.get((id(module), name))
                    if old is not None and new is not None and new is not old:
                        module._parameters[name] = old
                        cut_in_place(old, new, kept=None)  # a fresh module's replay: no gradient to cut
    return None


def _history_by_event(
    history: Sequence[Sequence[Any]], events: Sequence[int] | None
) -> Iterator[Sequence[Sequence[Any]]]:
    # the entries of each event in turn; a history cut short (the cuts before a distillation teacher's event)
    # ends within the counts, and entries past them (none counted: an older checkpoint's) form one event
    start = 0
    for count in events or ():
        if start >= len(history):
            return
        if int(count) <= 0:
            continue
        yield history[start : start + int(count)]
        start += int(count)
    if start < len(history):
        yield history[start:]


def channel_counts(model: nn.Module, names: Sequence[str]) -> dict[str, int]:
    """Current output channels of the named layers (``out_channels`` / ``out_features`` / ``num_features`` /
    ``embedding_dim``: what torch-pruning cuts)."""
    modules = dict(model.named_modules())
    counts = {}
    for name in names:
        module = modules.get(name)
        if module is None:
            continue
        for attribute in ("out_channels", "out_features", "num_features", "embedding_dim"):
            if isinstance(getattr(module, attribute, None), int):
                counts[name] = int(getattr(module, attribute))
                break
    return counts


def channel_sparsity(
    counts: Mapping[str, int], original_channels: Mapping[str, int]
) -> tuple[float, dict[str, float]]:
    """Global and per-layer share of original channels removed."""
    per_layer = {
        name: 1.0 - counts[name] / original_channels[name] for name in original_channels if name in counts
    }
    total = sum(original_channels[name] for name in per_layer)
    left = sum(counts[name] for name in per_layer)
    return (1.0 - left / total if total else 0.0), per_layer


# ---------------------------------------------------------------------------------------------- example inputs
def example_input(module: nn.Module, batch: Any) -> Any:
    """What to trace ``module`` with: its ``example_input_array`` if set, else the arguments of its ``forward``
    taken from ``batch`` (:func:`~lightning_pulse.core.prune_targets.example_from_batch`).

    Raises:
        ValueError: the reason no call can be made.
    """
    example = getattr(module, "example_input_array", None)
    if example is not None:
        return example
    if batch is None:
        raise ValueError("no training batch seen yet to trace the model with")
    return prune_targets.example_from_batch(module, batch)


def structured_blocker(model: nn.Module, selection: LayerSelection) -> str | None:
    """Why structured pruning cannot run on ``model`` with these layers at all, or ``None``: no ``forward``
    to trace, or Hugging Face ``Conv1D`` layers, which torch-pruning has no pruner for."""
    if not prune_targets.has_own_forward(model):
        return f"{type(model).__name__} has no `forward` to trace the model with"
    conv1d = [name for name, layer in selection.layers.items() if prune_targets.is_hf_conv1d(layer)]
    if conv1d:
        return f"{HF_CONV1D} ({first_names(conv1d, 1)})"
    return None


#: the start of the reason for selected Hugging Face ``Conv1D`` layers (:func:`structured_blocker`)
HF_CONV1D = "torch-pruning cannot cut Hugging Face Conv1D layers"


def check_structured(
    model: nn.Module, pruner: Pruner, sparsities: Sequence[float], example: Any
) -> str | None:
    """Prune a copy of ``model`` to each of ``sparsities`` in turn, as ``pruner`` would, and call it on
    ``example`` after each: intermediate channel counts break models that final ones do not (a head size
    that must divide the width).

    Returns why that is not safe (an error, a changed output shape, nothing that can be cut, chosen layers run
    with autograd off, where the trace cannot see them: :data:`REENTRANT_CHECKPOINT`, :data:`AUTOGRAD_OFF`;
    every channel group also cuts a layer the user froze: :data:`FROZEN_COUPLING`; nothing is left once the
    layers the user froze are left out: :data:`FROZEN_LEFT_OUT`, :data:`FROZEN_AND_UNCUTTABLE`; a buffer the
    cut leaves shaped like a parameter it changes: :data:`UNCUT_BUFFER`; an AveragedModel copy of a part the
    cut changes, left as it is: :data:`UNCUT_AVERAGE`), or ``None``.

    A cut that fails on a model with dead branches (layers the forward runs and discards the outputs of) is
    checked again with them traced (:func:`_retried_with_dead_branches`); where that one passes,
    :attr:`Pruner.trace_dead_branches` is set, so the events trace them too.
    """
    traced_before = pruner.trace_dead_branches
    reason, where = _trial_cut(model, pruner, pruner.exclude_pattern, sparsities, example)
    dead: list[str] = []
    if reason is not None and reason.startswith(CUT_FAILED) and not traced_before:
        reason, where, dead = _retried_with_dead_branches(model, pruner, sparsities, example, reason, where)
    if reason is not None and reason.startswith("tracing which channels"):
        if ON_HYPER_CONNECTION_STREAMS in reason:  # only the groups reaching the streams never end
            hint = _stream_writers_way_out(model, pruner, sparsities, example)
        elif LOSS_IN_OUTPUT in reason:
            # which one held the search up, the attention or the loss, only a cut tells: rotary attention
            # (HF Gemma, StableLM, Granite) holds it up with the loss in the output or not, and leaving the
            # attention out is enough; HF DETR's box matching holds it up with the attention left out too
            hint = _attention_way_out(model, pruner, sparsities, example)
            if hint is not None:  # returning the logits alone would only have led to a second refusal
                reason = reason.partition(f"; {LOSS_IN_OUTPUT}")[0]
        else:
            hint = attention_hint(model, pruner.exclude_pattern, pruner)
        reason = reason if hint is None else f"{reason}; {hint}"
    elif reason is not None and reason.startswith(CUT_FAILED):
        hooked = IN_USER_HOOK in reason and where is not None
        pre = f"the {user_hooks.HOOK_KINDS['_forward_pre_hooks']} " in reason
        hint = _hook_way_out(model, pruner, sparsities, example, where, pre) if hooked else None
        hint = hint or _way_out(model, pruner, sparsities, example, where)
        reason = reason if hint is None else f"{reason}; {hint}"
    elif reason == NOTHING_TO_CUT and (floor := _min_channels_floor(model, pruner, sparsities, example)):
        reason = floor
    elif reason == NOTHING_TO_CUT and pruner.user_frozen:
        reason = _nothing_to_cut_with_frozen(model, pruner, sparsities, example) or reason
    if reason == NOTHING_TO_CUT:
        reason = (
            _called_more_than_once(model, pruner, example)
            or _parametrized_left_out(model, pruner)
            or _shared_left_out(model, pruner)
            or reason
        )
    if reason is not None:
        pruner.trace_dead_branches = traced_before
        if dead:
            reason = f"{reason}; {DEAD_BRANCHES_CHECKED}: {first_names(dead, 3)}"
    return reason


def _retried_with_dead_branches(
    model: nn.Module,
    pruner: Pruner,
    sparsities: Sequence[float],
    example: Any,
    reason: str,
    where: str | None,
) -> tuple[str | None, str | None, list[str]]:
    """The trial cut that failed with ``reason`` in ``where`` done again with the dead branches traced, where
    the model has any (:func:`dead_branch_layers`): its reason and module, and the dead layers' names, with
    :attr:`Pruner.trace_dead_branches` set (``reason``, ``where`` and ``[]`` without dead layers).

    Tried only once the ordinary trace's cut failed: a forward that discards a loss (HF DETR's) holds no dead
    layer and traces as before, and the ordinary trace's graph is the one every model that passes keeps. A
    cut that fails the same way with them traced (they play no part), or a search that runs out of time with
    them, gives back the first failure and the ordinary trace (without the names where they play no part)."""
    dead = dead_branch_layers(model, example, pruner.run_precision)
    if not dead:
        return reason, where, []
    pruner.trace_dead_branches = True
    retried, retried_where = _trial_cut(model, pruner, pruner.exclude_pattern, sparsities, example)
    if (retried, retried_where) == (reason, where):  # the dead branches play no part (an unused HF pooler)
        pruner.trace_dead_branches = False
        return reason, where, []
    if retried is not None and retried.startswith("tracing which channels"):
        pruner.trace_dead_branches = False
        return reason, where, dead
    return retried, retried_where, dead


def _min_channels_floor(
    model: nn.Module, pruner: Pruner, sparsities: Sequence[float], example: Any
) -> str | None:
    """Why nothing could be cut when ``min_channels`` is what holds every channel group back (the trial cut
    passes with 1): :data:`MIN_CHANNELS_FLOOR`, the groups' widths and the values that leave a group
    channels to cut, checked by a trial cut. ``None`` with the default floor, or where 1 does not help either.
    A held-out CNN of 16-channel convs with ``min_channels=16`` was told to narrow ``layer_types``, which
    cannot help."""
    if pruner.min_channels <= 1:
        return None
    if _trial_cut(model, pruner, pruner.exclude_pattern, sparsities, example, min_channels=1)[0] is not None:
        return None
    duplicate = copy_without_hooks(model, keep_user_hooks=True).eval()
    try:
        graph = build_dependency_graph(
            duplicate, as_traced(example), pruner.run_precision, pruner.trace_dead_branches
        )
    except Exception:  # only a message needs this: the trial cut above traced the same model
        return None
    trial = pruner.for_trial()  # the trial cut's selection: user-frozen layers stay out
    groups = channel_groups(graph, duplicate, trial.layers(duplicate), pruner.user_frozen)
    if not groups:
        return None
    widths = {group.root: group.channels for group in groups}
    tied = {group.root: group.tied for group in groups}
    zeros = {root: torch.zeros(width // tied[root]) for root, width in widths.items()}

    def cuts(floor: int) -> bool:
        return bool(channels_to_remove(zeros, widths, max(sparsities), pruner.ranking, floor, tied))

    # fewer channels kept at a lower floor: the highest floor that still cuts, by bisection
    low, high = 1, pruner.min_channels - 1
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if cuts(middle) else (low, middle - 1)
    checked = (
        low if _trial_cut(model, pruner, pruner.exclude_pattern, sparsities, example, low)[0] is None else 1
    )
    widest = max(widths, key=widths.__getitem__)
    return (
        f"{MIN_CHANNELS_FLOOR}={pruner.min_channels}: every group would keep all its channels (the widest, "
        f"{widest}, has {widths[widest]}); a `min_channels` from 1 to {low} lets them be cut (the trial cut "
        f"passes with {checked})"
    )


def _shared_left_out(model: nn.Module, pruner: Pruner) -> str | None:
    """Why nothing could be cut when layers holding a parameter another module holds too (``b.weight =
    a.weight``, an embedding tied to the output layer) are left out: they are named, with the shared
    parameters and the way to let them be cut. ``None`` when there are none."""
    left_out = [
        name
        for name, why in pruner.selection(model).left_out.items()
        if why == prune_targets.SHARED_PARAMETER
    ]
    if not left_out:
        return None
    shared = prune_targets.shared_parameters_of(model, left_out)
    ties = "; ".join(" = ".join(f"`{owner}`" for owner in owners) for owners in list(shared.values())[:3])
    more = f" and {len(shared) - 3} more" if len(shared) > 3 else ""
    return f"{SHARED_LEFT_OUT}: {first_names(left_out, 3)} ({ties}{more})"


def _parametrized_left_out(model: nn.Module, pruner: Pruner) -> str | None:
    """Why nothing could be cut when layers whose weight a parametrization computes are left out: they are
    named, with the way to let them be cut. ``None`` when there are none."""
    left_out = [
        name for name, why in pruner.selection(model).left_out.items() if why == prune_targets.COMPUTED_WEIGHT
    ]
    if not left_out:
        return None
    them = "it" if len(left_out) == 1 else "them"
    removals: dict[str, list[str]] = {}
    for name in left_out:
        call = prune_targets.weight_computation_removal(model.get_submodule(name))
        removals.setdefault(call, []).append(name)
    # each kind its own call: `remove_parametrizations` raises on an old-style `weight_norm` hook
    calls = "; ".join(f"`{call}` for {first_names(names, 3)}" for call, names in removals.items())
    return (
        f"{NOTHING_TO_CUT}: {first_names(left_out, 3)} {'is' if them == 'it' else 'are'} left out (the "
        "weight is computed by a parametrization or a weight_norm/spectral_norm hook, which a cut cannot "
        f"follow), and so is every channel group that would cut {them}; remove it before the fit ({calls}) to "
        f"let {them} and the "
        f"layers next to {them} be cut"
    )


def _called_more_than_once(model: nn.Module, pruner: Pruner, example: Any) -> str | None:
    """Why nothing could be cut when selected layers run more than once per forward (one block applied at
    several depths): :data:`CALLED_MORE_THAN_ONCE` with them and their calls. ``None`` when none does (the
    output layers, never cut anyway, aside), or the model does not run on ``example``."""
    duplicate = copy_without_hooks(model, keep_user_hooks=True).eval()
    named = dict(duplicate.named_modules())
    layers = {name: named[name] for name in pruner.selection(model).layers if name in named}
    try:
        with _counting_calls(layers.values()) as calls, torch.no_grad():
            call_with(duplicate, inputs_for(duplicate, as_traced(example), pruner.run_precision))
    except Exception:  # only a message needs this: the trial cut said why the model cannot be cut
        return None
    outputs = set(output_layers(model, layers, example, pruner.run_precision, pruner.trace_dead_branches))
    repeated = {
        name: calls.get(layer, 0)
        for name, layer in layers.items()
        if calls.get(layer, 0) > 1 and name not in outputs
    }
    if not repeated:
        return None
    shown = ", ".join(f"{name} x{count}" for name, count in list(repeated.items())[:3])
    more = f" and {len(repeated) - 3} more" if len(repeated) > 3 else ""
    return f"{CALLED_MORE_THAN_ONCE} ({shown}{more})"


def _nothing_to_cut_with_frozen(
    model: nn.Module, pruner: Pruner, sparsities: Sequence[float], example: Any
) -> str | None:
    """Why a trial cut that cut nothing did so, on a model with layers the user froze: they are left out of
    the cut, and so is every group that would cut one of them too. ``None``: they play no part (frozen layers
    of other types only, and without them nothing can be cut either)."""
    selection = pruner.selection(model)
    left_out = [name for name in selection.left_out if name in pruner.user_frozen]
    unfrozen = _trial_cut(model, pruner, pruner.exclude_pattern, sparsities, example, frozen=frozenset())[0]
    outputs = output_layers(
        model, selection.layers, example, pruner.run_precision, pruner.trace_dead_branches
    )
    others = [name for name in selection.layers if name not in outputs]
    if unfrozen is None and (others or not left_out):
        frozen = first_names(sorted(pruner.user_frozen), 3)
        return f"{FROZEN_COUPLING} (`requires_grad=False`: {frozen}), whose weights must not change"
    if not left_out:
        return None
    shown = first_names(outputs, 3)
    if others:
        never_cut = f"; {shown}: the output layer, never cut" if outputs else ""
        left = (
            f"no channel group of the selected layers left ({first_names(others, 3)}{never_cut}) can be cut"
        )
    elif len(outputs) == 1:
        left = (
            f"the only selected layer left is {shown}, the model's output layer, whose outputs are never cut"
        )
    elif outputs:
        left = f"the only selected layers left, {shown}, are output layers, whose outputs are never cut"
    else:
        left = "no selected layer is left"
    frozen = f"(`requires_grad=False`: {first_names(left_out, 3)})"
    if unfrozen is None:
        return f"{FROZEN_LEFT_OUT} {frozen}: {left}"
    return f"{FROZEN_AND_UNCUTTABLE} {frozen}: with them left out, {left}; unfrozen, {unfrozen}"


def output_layers(
    model: nn.Module,
    layers: Mapping[str, nn.Module],
    example: Any,
    precision: RunPrecision | None = None,
    dead_branches: bool = False,
) -> list[str]:
    """The names of ``layers`` whose output channels reach the model's output (the classifier giving the
    logits): a cut of them changes the output's shape, so they are never cut. Traced on a copy of ``model``
    with ``example`` (the dead branches too with ``dead_branches``, whose outputs count then:
    :func:`build_dependency_graph`); ``[]`` when the trace fails."""
    duplicate = copy_without_hooks(model, keep_user_hooks=True).eval()
    named = dict(duplicate.named_modules())
    try:
        graph = build_dependency_graph(duplicate, as_traced(example), precision, dead_branches)
    except Exception:  # only a message needs this: a model the trace fails on is refused for that already
        return []
    found = []
    for name in layers:
        module = named[name]
        pruner = graph.get_pruner_of_module(module) if module in graph.module2node else None
        if pruner is None or pruner.get_out_channels(module) is None:
            continue
        group = graph.get_pruning_group(module, pruner.prune_out_channels, [0])
        if _touches_output(graph, group):
            found.append(name)
    return found


def _trial_cut(
    model: nn.Module,
    pruner: Pruner,
    exclude_pattern: str | None,
    sparsities: Sequence[float],
    example: Any,
    min_channels: int | None = None,
    frozen: frozenset[str] | None = None,
) -> tuple[str | None, str | None]:
    """:func:`check_structured`'s dry run on a copy, with ``exclude_pattern``, the floor ``min_channels``
    and the user-frozen layers ``frozen`` (``None``: the pruner's): why the cut is not safe (or ``None``), and
    the module of ``model`` a failing call broke in (or ``None``)."""
    # the events' selection: `()` goes back to the `None` it was resolved from; user-frozen layers stay out
    trial = pruner.for_trial(exclude_pattern=exclude_pattern, min_channels=min_channels)
    trial.user_frozen = pruner.user_frozen if frozen is None else frozen
    trial.example_inputs = as_traced(example)  # as given: the caller chose its size (small_example)
    duplicate = copy_without_hooks(
        model, keep_user_hooks=True
    ).eval()  # eval: no dropout draws, no batch-norm statistics
    inputs = inputs_for(duplicate, trial.example_inputs, pruner.run_precision)
    # the check must not change the run it checks: random draws happen on forked generators
    with torch.random.fork_rng(devices=_cuda_devices(duplicate)):
        _for_the_value_check(duplicate)
        try:
            reason = _dry_run(duplicate, trial, sparsities, example, inputs)
        except _CutFailed as failed:
            return failed.reason, failed.where
    copies = prune_targets.uncut_buffer_copies(model, duplicate) if reason is None else []
    if copies:
        buffer, parameter = copies[0]
        layer = parameter.rpartition(".")[0]
        shape = tuple(model.get_buffer(buffer).shape)
        others = len(copies) - 1
        more = f" (and {others} more such buffer{'s' if others > 1 else ''})" if others else ""
        reason = (
            f"{UNCUT_BUFFER}: `{buffer}`{more} has the shape {shape} of `{parameter}`, which the cut changes "
            f"(`exclude_pattern`={re.escape(layer)!r} leaves {layer} out)"
        )
    averages = prune_targets.uncut_averaged_copies(model, duplicate) if reason is None else []
    if averages:
        copy, part = averages[0]
        reason = f"{UNCUT_AVERAGE}: the cut changes shapes of `{part}`, which `{copy}` averages"
    return reason, None


#: the start of the reason for a model that raised on the example before any cut
NOT_RUN_ON_EXAMPLE = "the model does not run on the example it is traced with, before any cut"
#: how a trial cut that raised is reported (the refusal's reason starts with it)
CUT_FAILED = "pruning a copy of the model failed"
#: the start of the reason for a dependency graph torch-pruning could not build on the uncut model: it builds
#: the graph of the whole model, whatever layers are chosen, so no `exclude_pattern` changes it
GRAPH_BUILD_FAILED = (
    "torch-pruning could not build its dependency graph of this model (which channels depend on which), "
    "before any cut"
)
#: how a way out says that a trial cut checked the ``exclude_pattern`` it offers
TRIAL_CUT_PASSES = "the trial cut passes"
#: how a failed trial cut's reason says that no ``exclude_pattern`` the search tried let it pass, or that it
#: found none to try (every one would leave no layer to cut), where it ran its course (not stopped by
#: :class:`_TrialClock`): no narrowing is offered then
NO_PATTERN_PASSES = "no `exclude_pattern` it checked lets the trial cut pass"
NO_PATTERN_TO_CHECK = "it found no `exclude_pattern` to check"
#: how the reason for a dependency search that ran out of time names HyperConnection layers: torch-pruning's
#: search on their streams never ends (see :func:`_endless_search_on_streams`)
ON_HYPER_CONNECTION_STREAMS = "on the streams of HyperConnection layers"

#: how the reason for a trial cut that failed in a layer behind ``torch.nn.utils.prune`` masks says so: a cut
#: sets its weight to a smaller parameter, which the masks' pre-hook then fails to overwrite (a ``TypeError``)
ON_USER_MASKS = "on `torch.nn.utils.prune` masks, which a cut cannot carry along"
#: how the reason for a trial cut that failed in a forward hook the user registered says so
IN_USER_HOOK = "in a hook you registered"
#: the start of the reason for chosen layers that ran with autograd off in a reentrant activation checkpoint
REENTRANT_CHECKPOINT = (
    "its forward runs layers under reentrant activation checkpointing (torch.utils.checkpoint or "
    "checkpoint_sequential with use_reentrant=True), which runs them without autograd, so torch-pruning's "
    "dependency graph cannot see them or which channels they read"
)
#: the start of the reason for chosen layers that ran with autograd off otherwise
AUTOGRAD_OFF = (
    "its forward runs layers to prune with autograd off (in a `torch.no_grad()` block, or in a reentrant "
    "checkpoint whose inputs need no grad), so torch-pruning's dependency graph cannot see them or which "
    "channels they read"
)
#: the start of the reason for a trial cut that cuts nothing only because of the layers the user froze
FROZEN_COUPLING = "every channel group of the selected layers also cuts a layer you froze"
#: the start of the reason for a trial cut that cuts nothing once the layers the user froze are left out, and
#: would cut some with them unfrozen
FROZEN_LEFT_OUT = "nothing is left to cut once the layers you froze are left out"
#: the start of the reason for a trial cut that cuts nothing with the layers the user froze left out or not
FROZEN_AND_UNCUTTABLE = "nothing can be cut, with or without the layers you froze"
#: the start of the reason for a model output holding more than tensors in tuples, lists and dicts
UNTRACEABLE_OUTPUT = (
    "the model's output holds an object torch-pruning's trace cannot follow (it follows only tensors, in "
    "tuples, lists and dicts)"
)
#: how the reason for a dependency search that ran out of time names a loss in the model's output
LOSS_IN_OUTPUT = "the model's output holds its loss"
#: how a refusal says that the trial cut was checked again with the dead branches traced, naming their layers
DEAD_BRANCHES_CHECKED = (
    "the trial cuts traced too the layers whose outputs the forward runs and discards (a dead branch, which "
    "torch-pruning's trace of the output alone does not see)"
)
#: the reason for a trial cut that cut nothing
NOTHING_TO_CUT = "no channel group of the selected layers can be cut safely"
#: the start of the reason for a trial cut that cut nothing because of ``min_channels``
MIN_CHANNELS_FLOOR = f"{NOTHING_TO_CUT} above `min_channels`"
#: the start of the reason for a trial cut that cut nothing while selected layers hold a shared parameter
SHARED_LEFT_OUT = (
    f"{NOTHING_TO_CUT}: a layer holding a parameter that another module holds too is left out (a cut of one "
    "owner would leave the other with a weight of the wrong shape), and so is every channel group that would "
    "cut it"
)
#: the start of the reason for a trial cut that cut nothing while selected layers run more than once per
#: forward
CALLED_MORE_THAN_ONCE = (
    f"{NOTHING_TO_CUT}: the selected layers are called more than once per forward (one module applied at "
    "several depths, its weights shared across them), and a module called more than once is never cut, nor a "
    "channel group coupled to one"
)
#: the start of the reason for a buffer shaped like a parameter the cut changes, which the cut leaves as it is
UNCUT_BUFFER = (
    "the model holds a buffer shaped like a parameter the cut changes, and the cut leaves the buffer as it is: "
    "a copy of the weights kept as buffers (an EMA updated by parameter name) then no longer fits them, and the "
    "first update after the first pruning event fails"
)

#: the start of the reason for an AveragedModel copy of a part whose shapes the cut changes and not its own
UNCUT_AVERAGE = (
    "the model holds an AveragedModel (EMA/SWA) copy of a part the cut changes, and the cut leaves the copy "
    "as it is: `update_parameters` pairs their tensors by position, and its first update after the first "
    "pruning event fails"
)


@contextmanager
def _run_without_autograd(layers: Mapping[str, nn.Module]) -> Iterator[set[str]]:
    """Gives the set that holds, once the block is over, the names of ``layers`` that ran in it with autograd
    off only: torch-pruning traces the autograd graph, so it does not see them, nor which channels they
    read."""
    with_grad: set[str] = set()
    without: set[str] = set()

    def recorder(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any) -> None:
            (with_grad if torch.is_grad_enabled() else without).add(name)

        return record

    handles = [layer.register_forward_pre_hook(recorder(name)) for name, layer in layers.items()]
    found: set[str] = set()
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
        found.update(without - with_grad)


def _autograd_off_reason(names: Sequence[str], output: Any) -> str:
    """:data:`REENTRANT_CHECKPOINT` when ``output``'s autograd graph holds a reentrant checkpoint's node (it
    stands for the whole checkpointed block), else :data:`AUTOGRAD_OFF`; with the layers ``names``."""
    seen, stack = set(), [tensor.grad_fn for tensor in _floating_tensors(output)]
    cause = AUTOGRAD_OFF
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if type(node).__name__ == "CheckpointFunctionBackward":
            cause = REENTRANT_CHECKPOINT
            break
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return f"{cause} ({first_names(names, 3)})"


#: how many exclusions :func:`_way_out` adds and checks before it gives up on naming one that works
WAY_OUT_TRIES = 3
#: how many more trial cuts :func:`_way_out` spends leaving chosen layers out by name (:func:`_layer_search`)
LAYER_SEARCH_TRIES = 4
#: past this many seconds of checking exclusions, :func:`_way_out` starts no further trial cut
WAY_OUT_SECONDS = 30.0
#: after one trial cut this slow, :func:`_way_out` starts no further one: the next would be as slow
SLOW_TRIAL_SECONDS = 10.0


class _TrialClock:
    """Trial cuts timed for :func:`_way_out`, which starts no further one past :data:`WAY_OUT_SECONDS` of
    checking exclusions or after one of its cuts took :data:`SLOW_TRIAL_SECONDS` (the failed cut it looks for
    a way out of is not counted: the first pattern, the attention left out say, is worth one more)."""

    def __init__(self) -> None:
        self.started, self.slowest = time.monotonic(), 0.0

    def cut(self, *args: Any) -> tuple[str | None, str | None]:
        began = time.monotonic()
        try:
            return _trial_cut(*args)
        finally:
            self.slowest = max(self.slowest, time.monotonic() - began)

    def out_of_time(self) -> bool:
        return self.slowest >= SLOW_TRIAL_SECONDS or time.monotonic() - self.started >= WAY_OUT_SECONDS


def _way_out(
    model: nn.Module, pruner: Pruner, sparsities: Sequence[float], example: Any, where: str | None
) -> str | None:
    """The ``exclude_pattern`` to offer after a failed trial cut, checked by cutting again with it.

    The pattern leaves out the part the call broke in: the attention modules when it broke inside one (a head
    reshape), else the innermost part around the failing module that holds a chosen layer (the convolutions
    feeding a ``GroupNorm`` whose groups must divide their channels), then the attention modules. A cut that
    then breaks elsewhere keeps that pattern and adds the new part's too; one that breaks in the same place
    drops it. A pattern that leaves out no chosen layer the user's pattern leaves in (the user's own, again)
    or every one of them (the module holding the whole model) is not tried. Where none passes within
    :data:`WAY_OUT_TRIES` cuts, chosen layers are left out by name (:func:`_layer_search`: the break is in the
    model's own ``forward``, or in a layer whose input another one cuts). Where no pattern passes, the failing
    module is named, with the patterns that failed, and no pattern is offered (:data:`NO_PATTERN_PASSES` or
    :data:`NO_PATTERN_TO_CHECK` where the search ran its course; a search out of time says so). Where
    that search finds none either, wider parts around the break are left out (:func:`_wider_way_out`).
    :class:`_TrialClock` says when no further trial cut starts.

    The pattern offered has no part the others make needless (:func:`_without_needless`): where the first
    break depends on the sparsity (a head reshape at 0.5, a grouped convolution at 0.3), the searches from
    each end at the same pattern. It says what it leaves to cut (:func:`_left_to_cut`): a pattern that leaves
    out every block leaves little, and the refusal must not read as if the model were cut as asked."""
    clock, tries, failed = _TrialClock(), 0, []
    current = pruner.exclude_pattern
    place = "" if where is None else f"it broke in {where} ({type(model.get_submodule(where)).__name__})"

    def passes(with_pattern: str) -> str:
        offered = _without_needless(model, pruner, with_pattern)
        return (
            f"{place}; with `exclude_pattern`={offered!r} {TRIAL_CUT_PASSES} and "
            f"{_left_to_cut(model, pruner, offered)}"
        )

    while tries < WAY_OUT_TRIES and not clock.out_of_time():
        candidates = _exclusions_for(model, pruner, where, current)
        pattern = next((p for p in candidates if _joined(current, p) not in failed), None)
        if pattern is None:
            break
        tries += 1
        trial_pattern = _joined(current, pattern)
        reason, broke_in = clock.cut(model, pruner, trial_pattern, sparsities, example)
        if reason is None:
            return passes(trial_pattern).lstrip("; ")
        failed.append(trial_pattern)
        if reason.startswith("tracing which channels"):  # out of time: a search by layer would be as well
            return f"{place}; the trial cut does not pass with `exclude_pattern`={trial_pattern!r} either"
        if not reason.startswith(CUT_FAILED):
            break
        if broke_in != where:  # this part was the trouble there: keep it out, and look at the next one
            current, where = trial_pattern, broke_in
    found, searched = _layer_search(model, pruner, current, sparsities, example, where, clock)
    if found is None:
        found = _wider_way_out(model, pruner, current, sparsities, example, where, clock, failed)
    if found is not None:
        return passes(found).lstrip("; ")
    tried = [repr(pattern) for pattern in failed[:3]] + (
        ["chosen layers left out by name"] if searched else []
    )
    checked = f" ({', '.join(tried)})" if tried else ""
    if clock.out_of_time():  # a pattern it had no time for may pass: the refusal still offers narrowing
        said = f"no `exclude_pattern` it checked in time lets the trial cut pass{checked}"
    else:
        said = f"{NO_PATTERN_PASSES}{checked}" if tried else NO_PATTERN_TO_CHECK
    return f"{place}; {said}".lstrip("; ")


def _joined(*patterns: str | None) -> str:
    return "|".join(pattern for pattern in patterns if pattern)


def _exclusions_for(model: nn.Module, pruner: Pruner, where: str | None, current: str | None) -> list[str]:
    """The patterns :func:`_way_out` tries for a break in ``where``, best first: each leaves out some but not
    all of the layers that ``current`` leaves chosen."""
    attention = attention_pattern(model, current)
    around = None if where is None or _in_attention(model, where) else _exclusion_for(model, where)
    chosen = set(_chosen(model, pruner, current))
    found: list[str] = []
    for pattern in (around, None if attention is None else attention[0]):
        left = set(_chosen(model, pruner, _joined(current, pattern))) if pattern else chosen
        if left != chosen and left and pattern not in found:
            found.append(pattern)
    return found


def _chosen(model: nn.Module, pruner: Pruner, exclude_pattern: str | None) -> list[str]:
    """The layers ``pruner`` would choose with ``exclude_pattern`` instead of its own."""
    narrowed = copy.copy(pruner)
    narrowed.exclude_pattern = exclude_pattern
    return list(narrowed.selection(model).layers)


def _layer_search(
    model: nn.Module,
    pruner: Pruner,
    current: str | None,
    sparsities: Sequence[float],
    example: Any,
    where: str | None,
    clock: _TrialClock,
) -> tuple[str | None, int]:
    """A pattern that leaves out chosen layers by name and lets the trial cut pass, or ``None``, with the
    number of trial cuts it took. The chosen layers (the output layers, never cut, aside) are halved in their
    order, and the half whose leaving out passes is halved again, up to :data:`LAYER_SEARCH_TRIES` cuts; the
    smallest half that passed is offered.
    A break in the model's own ``forward`` (a fixed ``.view`` of a layer's output) names no part to leave out,
    but one layer, or a few, are what it reads. A half whose leaving out moves the break away from ``where``
    (the one searched for) got past it: the part the cut then breaks in is left out too (the attention of an
    HF backbone under a head that reshapes in ``forward``: without the attention every half fails, without
    the head's layer the attention breaks), and that half is halved further with that part left out."""
    chosen = _chosen(model, pruner, current)
    named = {name: model.get_submodule(name) for name in chosen}
    try:
        outputs = set(output_layers(model, named, example, pruner.run_precision, pruner.trace_dead_branches))
    # only a message needs this: torch-pruning's own search can fail (a GRU's index mapping)
    except Exception:
        outputs = set()
    candidates = [name for name in chosen if name not in outputs]
    passing, tries = None, 0

    def cut(pattern: str) -> tuple[str | None, str | None] | None:
        nonlocal tries
        if tries >= LAYER_SEARCH_TRIES or clock.out_of_time():
            return None
        tries += 1
        return clock.cut(model, pruner, pattern, sparsities, example)

    while len(candidates) > 1:
        half = len(candidates) // 2
        for part in (candidates[:half], candidates[half:]):
            tried = cut(_joined(current, exact_names_pattern(part)))
            if tried is None:
                return passing, tries
            reason, broke_in = tried
            if reason is not None and reason.startswith(CUT_FAILED) and broke_in != where:
                # past the break searched for: the new one's part goes too, if that leaves some layer cut
                part_out = _joined(current, exact_names_pattern(part))
                extra = next(iter(_exclusions_for(model, pruner, broke_in, part_out)), None)
                widened = _joined(current, extra)
                left = set(_chosen(model, pruner, widened))
                kept = [name for name in part if name in left]  # none: that part alone, tried before
                if extra is not None and kept:
                    pattern = _joined(widened, exact_names_pattern(kept))
                    tried = cut(pattern)
                    if tried is None:
                        return passing, tries
                    reason, _ = tried
                    if reason is None:
                        passing, current, candidates = pattern, widened, kept
                        break
            if reason is None:
                passing, candidates = _joined(current, exact_names_pattern(part)), part
                break
            if not reason.startswith((CUT_FAILED, NOTHING_TO_CUT)):  # out of time, say: no further search
                return passing, tries
        else:
            break
    return passing, tries


def _attention_way_out(
    model: nn.Module, pruner: Pruner, sparsities: Sequence[float], example: Any
) -> str | None:
    """The attention modules left out, checked by a trial cut, after the dependency search ran out of time on a
    model whose output holds its loss: the ``exclude_pattern`` to offer, or ``None`` when the model has no
    attention or the search does not end without it either (the loss holds it up: HF DETR). A cut that then
    fails is refined by :func:`_way_out`. Costs one more search, bounded as the first."""
    found = attention_pattern(model, pruner.exclude_pattern)
    if found is None:
        return None
    attention, outermost = found
    pattern = _joined(pruner.exclude_pattern, attention)
    reason, where = _trial_cut(model, pruner, pattern, sparsities, example)
    if reason is None:
        more = f" and {len(outermost) - 1} more" if len(outermost) > 1 else ""
        return (
            f"with the model's attention modules ({outermost[0]}{more}) left out, `exclude_pattern`="
            f"{pattern!r}, {TRIAL_CUT_PASSES} and {_left_to_cut(model, pruner, pattern)}"
        )
    if not reason.startswith(CUT_FAILED):  # out of time again, or nothing left to cut
        return None
    return _refined_way_out(model, pruner, pattern, sparsities, example, where)


def _stream_writers_way_out(
    model: nn.Module, pruner: Pruner, sparsities: Sequence[float], example: Any
) -> str | None:
    """The ``exclude_pattern`` to offer after the dependency search ran out of time on HyperConnection
    streams, checked by a trial cut: only the channel groups that reach the streams never end, and they start
    at the chosen layers as wide as the streams. First those that write into them (:func:`_stream_writers`:
    each block's last layer, the layers before ``expand_streams``) are left out by name, then, where that
    fails, every chosen layer as wide as the streams (:func:`_way_out` refines a cut that then fails).
    ``None`` when no chosen layer is that wide or no pattern passes. A trial cut that runs out of time too
    ends the search for a pattern (the refusal comes after two searches)."""
    widths = {
        part.dim for part in model.modules() if isinstance(part, HyperConnection) and part.n_streams > 1
    }
    chosen = list(pruner.selection(model).layers)
    wide = [name for name, count in channel_counts(model, chosen).items() if count in widths]
    if not wide:
        return None
    writers = _stream_writers(model, wide)
    if writers != wide:  # a residual branch of layers all as wide as the streams: only its last one writes
        pattern = "|".join(part for part in (pruner.exclude_pattern, exact_names_pattern(writers)) if part)
        reason, _ = _trial_cut(model, pruner, pattern, sparsities, example)
        if reason is None:
            return (
                f"with `exclude_pattern`={pattern!r} (the layers writing into the streams) "
                f"{TRIAL_CUT_PASSES} and {_left_to_cut(model, pruner, pattern)}"
            )
        if not reason.startswith((CUT_FAILED, NOTHING_TO_CUT)):  # out of time again: no third search
            return None
    pattern = "|".join(part for part in (pruner.exclude_pattern, exact_names_pattern(wide)) if part)
    reason, where = _trial_cut(model, pruner, pattern, sparsities, example)
    if reason is None:
        which = (
            "the layers writing into the streams" if writers == wide else "the chosen layers as wide as them"
        )
        return (
            f"with `exclude_pattern`={pattern!r} ({which}) {TRIAL_CUT_PASSES} and "
            f"{_left_to_cut(model, pruner, pattern)}"
        )
    if not reason.startswith(CUT_FAILED):
        return None
    return _refined_way_out(model, pruner, pattern, sparsities, example, where)


def _refined_way_out(
    model: nn.Module,
    pruner: Pruner,
    pattern: str,
    sparsities: Sequence[float],
    example: Any,
    where: str | None,
) -> str | None:
    """:func:`_way_out` from ``pattern``, whose trial cut failed at ``where``: the refined pattern it offers
    where its cut passes, else ``None``."""
    narrowed = copy.copy(pruner)
    narrowed.exclude_pattern = pattern
    hint = _way_out(model, narrowed, sparsities, example, where)
    return hint if hint is not None and TRIAL_CUT_PASSES in hint else None


def _stream_writers(model: nn.Module, wide: Sequence[str]) -> list[str]:
    """Of the chosen layers ``wide`` (as wide as the streams), those that write into them: the ones outside
    every HyperConnection's branch (the layer before ``expand_streams``), and in each branch its last layer
    with a weight and what follows it (a norm); the layers before it in the branch (a ResNet branch's first
    convolution) feed only that one and can be cut."""
    branches = [
        (f"{name}.branch." if name else "branch.")
        for name, part in model.named_modules()
        if isinstance(part, HyperConnection) and part.n_streams > 1
    ]
    writers = [name for name in wide if not any(name.startswith(prefix) for prefix in branches)]
    for prefix in branches:
        inside = [name for name in wide if name.startswith(prefix)]  # in registration order
        weighted = [
            name
            for name in inside
            if not isinstance(model.get_submodule(name), nn.modules.batchnorm._NormBase)
        ]
        if weighted:
            writers += inside[inside.index(weighted[-1]) :]
    return [name for name in wide if name in set(writers)]


def exact_names_pattern(names: Iterable[str]) -> str:
    """An ``exclude_pattern`` that matches exactly the layers ``names``, for a refusal's way out."""
    return "^(" + "|".join(re.escape(name) for name in names) + ")$"


def _hook_way_out(
    model: nn.Module, pruner: Pruner, sparsities: Sequence[float], example: Any, hooked: str, pre: bool
) -> str | None:
    """The ``exclude_pattern`` to offer after a trial cut failed in a hook the user registered on ``hooked``:
    the selected layers whose channel groups cut ``hooked``'s inputs (a ``pre`` hook) or outputs, where the
    hook's fixed widths are, checked by cutting again without them. ``None``: no group reaches ``hooked`` (a
    hook on the model itself), or the cut fails without them as well."""
    duplicate = copy_without_hooks(model, keep_user_hooks=True).eval()
    named = dict(duplicate.named_modules())
    try:
        graph = build_dependency_graph(
            duplicate, as_traced(example), pruner.run_precision, pruner.trace_dead_branches
        )
    except Exception:  # only a message needs this: the trial cut said why the model cannot be cut
        return None
    target = named[hooked]
    own = graph.get_pruner_of_module(target) if target in graph.module2node else None
    # one pruning function for inputs and outputs (a norm, a depthwise conv): either cut reaches both
    shared = own is not None and getattr(own, "prune_in_channels", None) == own.prune_out_channels

    def reaches(dependency: Any) -> bool:
        out = graph.is_out_channel_pruning_fn(dependency.handler)
        return dependency.target.module is target and (shared or out != pre)

    reaching = []
    for name in pruner.selection(model).layers:
        module = named[name]
        handler = graph.get_pruner_of_module(module) if module in graph.module2node else None
        if handler is None or handler.get_out_channels(module) is None:
            continue
        group = graph.get_pruning_group(module, handler.prune_out_channels, [0])
        if any(reaches(dependency) for dependency, _ in group):
            reaching.append(name)
    if not reaching:
        return None
    left_out = "|".join(re.escape(name) for name in reaching)
    left_out = f"^{left_out}$" if len(reaching) == 1 else f"^({left_out})$"
    pattern = "|".join(p for p in (pruner.exclude_pattern, left_out) if p)
    if _trial_cut(model, pruner, pattern, sparsities, example)[0] is not None:
        return None
    return (
        f"leave out the layers whose channels reach `{hooked}` ({first_names(reaching, 3)}): with "
        f"`exclude_pattern`={pattern!r} the trial cut passes and {_left_to_cut(model, pruner, pattern)}; or "
        "make the hook read its widths from the tensors it gets"
    )


def _exclusion_for(model: nn.Module, where: str) -> str | None:
    """The pattern that leaves out the innermost part around ``where`` that holds another layer with a weight
    (see :func:`_way_out`), or ``None``."""
    return next(iter(_exclusions_around(model, where)), None)


def _exclusions_around(model: nn.Module, where: str) -> list[str]:
    """The patterns that leave out the parts around ``where`` holding another layer with a weight, innermost
    first: each the last name component of its part that is not an index (``layers.0``: ``layers``)."""
    weighted = _weighted_names(model)
    parts, found = where.split("."), []
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        holds_layer = any(n == prefix or n.startswith(prefix + ".") for n in weighted if n != where)
        component = next((part for part in reversed(parts[:end]) if not part.isdigit()), None)
        if holds_layer and component is not None and re.escape(component) not in found:
            found.append(re.escape(component))
    return found


#: how many trial cuts :func:`_wider_way_out` spends on wider parts around the break
WIDER_TRIES = 2


def _wider_way_out(
    model: nn.Module,
    pruner: Pruner,
    current: str | None,
    sparsities: Sequence[float],
    example: Any,
    where: str | None,
    clock: _TrialClock,
    failed: list[str],
) -> str | None:
    """A pattern leaving out a wider part around ``where`` (the blocks holding it) that lets the trial cut
    pass, or ``None``; the patterns that fail are added to ``failed``. The last resort of :func:`_way_out`:
    where the cut breaks in a layer whose inputs its neighbours cut (a grouped convolution fed by the
    feed-forward layer before it), leaving out the layer's own part moves nothing, and the search by layer
    runs out of cuts. Such a pattern may leave little to cut, which the refusal says (:func:`_left_to_cut`).
    """
    if where is None:
        return None
    chosen, tries = set(_chosen(model, pruner, current)), 0
    for part in _exclusions_around(model, where):
        pattern = _joined(current, part)
        left = set(_chosen(model, pruner, pattern))
        if pattern in failed or left == chosen or not left:
            continue
        if tries >= WIDER_TRIES or clock.out_of_time():
            return None
        tries += 1
        reason, _ = clock.cut(model, pruner, pattern, sparsities, example)
        if reason is None:
            return pattern
        failed.append(pattern)
        if not reason.startswith((CUT_FAILED, NOTHING_TO_CUT)):  # out of time, say: no further search
            return None
    return None


def _alternatives(pattern: str) -> list[str]:
    """The top-level alternatives of ``pattern`` (split at each ``|`` outside brackets and escapes)."""
    found, depth, start, escaped = [], 0, 0, False
    for at, char in enumerate(pattern):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "|" and depth == 0:
            found.append(pattern[start:at])
            start = at + 1
    return [*found, pattern[start:]]


def _without_needless(model: nn.Module, pruner: Pruner, pattern: str) -> str:
    """``pattern`` without the alternatives :func:`_way_out` added that leave out no layer the others leave in
    (``'attention|layers'``: every attention module is in the layers, so ``'layers'``); the user's own
    ``exclude_pattern`` is kept whole. A search that began at another break gets to the same pattern."""
    own = pruner.exclude_pattern
    if own and not pattern.startswith(own + "|"):
        return pattern
    added = _alternatives(pattern[len(own) + 1 :] if own else pattern)
    keep = [True] * len(added)
    try:
        left = set(_chosen(model, pruner, pattern))
        for at in range(len(added)):
            fewer = [part for other, part in enumerate(added) if keep[other] and other != at]
            if fewer and set(_chosen(model, pruner, _joined(own, *fewer))) == left:
                keep[at] = False
    except re.error:  # only a message needs this: the pattern as the trial cut checked it
        return pattern
    return _joined(own, *(part for part, kept in zip(added, keep) if kept))


def _left_to_cut(model: nn.Module, pruner: Pruner, pattern: str) -> str:
    """What a checked ``pattern`` leaves to cut: how many layers, their share of the model's weights (as the
    fit-start line counts them), and their names where they are few."""
    left = _chosen(model, pruner, pattern)
    if not left:
        return "leaves no layer to cut"
    share = prune_targets.weight_share(model, {name: model.get_submodule(name) for name in left})
    shown = f"{share:.1%}" if share < 0.1 else f"{share:.0%}"
    names = f" ({', '.join(left)})" if len(left) <= 3 else ""
    layers = "layer" if len(left) == 1 else "layers"
    return f"leaves {len(left)} {layers} holding {shown} of the model's weights to cut{names}"


def _weighted_names(model: nn.Module) -> list[str]:
    """The names of the modules that hold a ``weight`` parameter of their own."""
    return [n for n, m in model.named_modules() if "weight" in getattr(m, "_parameters", {})]


def _in_attention(model: nn.Module, where: str) -> bool:
    modules = dict(model.named_modules())
    parts = where.split(".")
    return any(
        "attention" in type(modules[".".join(parts[:end])]).__name__.lower()
        for end in range(1, len(parts) + 1)
    )


class _CutFailed(Exception):
    def __init__(self, reason: str, where: str | None) -> None:
        super().__init__(reason)
        self.reason, self.where = reason, where


def _failing_module(duplicate: nn.Module, error: BaseException) -> str | None:
    """The name of the innermost module of ``duplicate`` that ``error`` came through: a traceback frame whose
    ``self`` is one of the copy's modules (its forward), or, in torch-pruning's own code, whose ``layer`` or
    ``module`` is (the pruner cutting it, e.g. a GRU it has no pruner for). ``None`` when no frame names one."""
    names = {id(module): name for name, module in duplicate.named_modules() if name}
    found, frame = None, error.__traceback__
    while frame is not None:
        local = frame.tb_frame.f_locals
        for key in ("self", "layer", "module"):
            owner = local.get(key)
            if isinstance(owner, nn.Module) and id(owner) in names:
                found = names[id(owner)]
                break
        frame = frame.tb_next
    return found


@torch.no_grad()
def _for_the_value_check(duplicate: nn.Module) -> None:
    """Make the copy that the check cuts show its structure in its values:

    * a parameter that is all zeros (a residual branch's last batch-norm scale under ``zero_init_residual``, a
      layer scale or a ReZero gate starting at 0) gets small random values: at zero a whole branch outputs 0,
      and any cut inside it, right or wrong, would leave the output unchanged until training moved it;
    * a ``LayerNorm`` or one-group ``GroupNorm`` without affine parameters gets an identity affine (ones and
      zeros: the same function), so the cut records which of its channels it kept.
    """
    for parameter in duplicate.parameters():
        if parameter.is_floating_point() and not parameter.any():
            parameter.normal_(0.0, 0.1)
    # the affine takes the model's dtype and device: a float32 one in a bf16-true/64-true model broke the trace
    like = next((p for p in duplicate.parameters() if p.is_floating_point()), None)
    place = {} if like is None else {"dtype": like.dtype, "device": like.device}
    for module in duplicate.modules():
        if isinstance(module, nn.LayerNorm) and module.weight is None and len(module.normalized_shape) == 1:
            module.weight = nn.Parameter(torch.ones(module.normalized_shape, **place))
            module.bias = nn.Parameter(torch.zeros(module.normalized_shape, **place))
            module.elementwise_affine = True
        elif isinstance(module, nn.GroupNorm) and module.weight is None and module.num_groups == 1:
            module.weight = nn.Parameter(torch.ones(module.num_channels, **place))
            module.bias = nn.Parameter(torch.zeros(module.num_channels, **place))
            module.affine = True


def attention_pattern(model: nn.Module, exclude_pattern: str | None) -> tuple[str, list[str]] | None:
    """The ``exclude_pattern`` that leaves out the model's attention modules that ``exclude_pattern`` leaves in,
    with the outermost of them, or ``None`` when it has none.

    The pattern is the last name component of the outermost attention modules (``attention``, ``self_attn``),
    or of the innermost ones where that component also names layers outside attention (T5's ``layer.0`` holds
    attention, ``layer.1`` the feed-forward: ``SelfAttention|EncDecAttention``).
    """
    names = [
        name
        for name, module in model.named_modules()
        if name
        and "attention" in type(module).__name__.lower()
        and not (exclude_pattern is not None and re.search(exclude_pattern, name))
    ]
    if not names:
        return None
    outermost = [n for n in names if not any(n.startswith(o + ".") for o in names)]
    innermost = [n for n in names if not any(o.startswith(n + ".") for o in names)]

    def component(name: str) -> str:
        return next((part for part in reversed(name.split(".")) if not part.isdigit()), name)

    def pattern_of(found: list[str]) -> str:
        return "|".join(sorted({component(name) for name in found}))

    pattern = pattern_of(outermost)
    inside = tuple(o + "." for o in outermost)
    if any(re.search(pattern, n) and not n.startswith(inside) for n in _weighted_names(model)):
        pattern = pattern_of(innermost)  # the outer component also names layers outside attention
    return pattern, outermost


def attention_hint(model: nn.Module, exclude_pattern: str | None, pruner: Pruner | None = None) -> str | None:
    """The attention modules as the likely cause of a trial cut that could not be finished (a head reshape breaks
    at intermediate widths), with their :func:`attention_pattern`, or ``None`` when the model has none. With
    ``pruner``, what the pattern leaves to cut (:func:`_left_to_cut`)."""
    found = attention_pattern(model, exclude_pattern)
    if found is None:
        return None
    pattern, outermost = found
    more = f" and {len(outermost) - 1} more" if len(outermost) > 1 else ""
    left = (
        " and the other layers are cut"
        if pruner is None
        else f", which {_left_to_cut(model, pruner, _joined(exclude_pattern, pattern))}"
    )
    return (
        f"the model's attention modules ({outermost[0]}{more}) are the usual cause, since head reshapes break at "
        f"intermediate widths: leave them out with `exclude_pattern`={pattern!r}{left}"
    )


#: Seconds the fit-start check of structured pruning may take. torch-pruning's dependency search ran for
#: over 10 minutes without an answer on a 90k-parameter Hugging Face Llama (rotary attention); on the models
#: it handles the whole check takes about a second, and each later pruning event costs about the same.
STRUCTURED_CHECK_SECONDS = 60.0


class _CheckTimeout(BaseException):
    """A BaseException: raised at any Python call of the search, it must pass the ``except Exception`` of the
    code it interrupts (ours that turns a failed cut into a reason, torch-pruning's): swallowed there, with the
    profile hook gone, the rest of the search ran unbounded."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`_CheckTimeout` inside the block once ``seconds`` have passed, at a Python call (the search
    to bound is pure Python). Through this thread's profile hook, so it stands aside while a profiler holds it."""
    if sys.getprofile() is not None:
        yield
        return
    deadline, calls, expired = time.monotonic() + seconds, 0, False
    # raised in a weakref callback or a finalizer that runs meanwhile (torch._dynamo's `_remove_id`, once a
    # compiled function is gone), the exception is ignored and CPython unhooks the profile all the same: the
    # search then ran unbounded (a suite run hung in it). So it is raised in the search's own code only.
    searcher = sys.modules.get("torch_pruning")
    search_files = (
        __file__,
        *([os.path.dirname(searcher.__file__)] if searcher and searcher.__file__ else []),
    )

    def check(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls, expired
        calls += 1
        if not expired and calls % 4096 == 0 and time.monotonic() > deadline:
            expired = True
        if expired and frame.f_code.co_filename.startswith(search_files):
            sys.setprofile(None)
            raise _CheckTimeout

    sys.setprofile(check)
    try:
        yield
    finally:
        sys.setprofile(None)


def _dry_run(
    duplicate: nn.Module, trial: Pruner, sparsities: Sequence[float], example: Any, inputs: Any
) -> str | None:
    loss = None
    try:
        with _time_limit(STRUCTURED_CHECK_SECONDS):
            try:  # with autograd, as torch-pruning traces it: do the layers to prune run with it?
                _same_draws(duplicate)
                with _run_without_autograd(trial.layers(duplicate)) as without, torch.enable_grad():
                    output = call_with(duplicate, inputs)
                before = prune_targets.output_shapes(output)
            except _CheckTimeout:
                raise
            except Exception as error:  # before any cut: the example, not a cut, is what fails
                # the way out depends on where the example came from: the caller says it (prune_setup)
                return f"{NOT_RUN_ON_EXAMPLE} ({type(error).__name__}: {str(error)[:200]})"
            if without:
                return _autograd_off_reason(sorted(without), output)
            untraceable = prune_targets.untraceable_output(output)
            if untraceable is not None:
                return f"{UNTRACEABLE_OUTPUT}: it holds {untraceable}"
            loss = _loss_in(output)
            del output
            in_training = _training_shapes(duplicate, inputs, cut=False)
            for sparsity in sparsities:
                uncut = copy_without_hooks(duplicate, keep_user_hooks=True)  # user hooks shared, not copied
                names = {id(parameter): name for name, parameter in duplicate.named_parameters()}
                # the cut model runs from the state the reference copy holds: the trace's forward writes
                # what a forward writes (a fake quantizer's observer, in eval mode too), given back here
                with kept_buffers(duplicate, written_only=True):
                    remap = trial.prune(duplicate, sparsity, (), example).remap
                with torch.no_grad():
                    _same_draws(duplicate)  # the reference draws the same numbers (a random mask in forward)
                    output = call_with(duplicate, inputs)
                    after = prune_targets.output_shapes(output)
                    if before != after:
                        return f"pruning to {sparsity:.2f} changes the model's output shapes from {before} to {after}"
                    changed = _changed_function(uncut, names, remap, inputs, output)
                if changed is not None:
                    return f"pruning to {sparsity:.2f} {changed}"
                if in_training is not None:
                    try:
                        training_shapes = _training_shapes(duplicate, inputs, cut=True)
                    except Exception as error:
                        return (
                            f"pruning to {sparsity:.2f} breaks the model in training mode ({type(error).__name__}: "
                            f"{str(error)[:200]}): a branch that runs only in training reads the cut channels"
                        )
                    if training_shapes != in_training:
                        return f"pruning to {sparsity:.2f} changes the model's output shapes in training mode"
    except _CheckTimeout:
        # the search goes through every op between the layers and the output: a loss's too
        through_loss = (
            ""
            if loss is None
            else (
                f"; {LOSS_IN_OUTPUT} ({loss}), whose graph the search goes through as well (on HF "
                "DETR the loss's box matching kept it from finishing): return what the model computes (its "
                "logits) from `forward`, and compute the loss in `training_step`"
            )
        )
        # named after what this model holds: held-out sweeps' mHC models (convolutional, and Linear-only) were
        # told of rotary attention, then of convolutions, they do not have
        seen_on = _endless_search_on_streams(duplicate) or "as on rotary-embedding attention"
        return (
            f"tracing which channels depend on which (torch-pruning's dependency search) did not finish within "
            f"{STRUCTURED_CHECK_SECONDS:g} s, {seen_on}{through_loss}"
        )
    except Exception as error:  # whatever the model does, the answer is a refusal, not a crash mid-run
        failure = f"({type(error).__name__}: {str(error)[:200]})"
        if not trial.history and _in_graph_build(error):
            # no layer to blame: a held-out sweep's HF Mllama was told to leave out `lm_head` around a failure
            # in torch-pruning's index mapping, which fails the same with it left out
            raise _CutFailed(f"{GRAPH_BUILD_FAILED} {failure}", None) from None
        reason = f"{CUT_FAILED} {failure}"
        hooked = user_hooks.failing_user_hook(duplicate, error)
        if hooked is None:
            where = _failing_module(duplicate, error)
            # a layer left out, whose channels follow a chosen layer's cut (chosen ones are refused at fit start)
            masked = user_masked_tensors(duplicate.get_submodule(where)) if where else []
            if masked:
                reason = (
                    f"{reason} {ON_USER_MASKS}: `{where}` carries them ({', '.join(masked)}), and the cut of a "
                    "chosen layer changes its channels; fold them before fit: `torch.nn.utils.prune.remove("
                    f'model.get_submodule("{where}"), "{masked[0]}")` on the LightningModule'
                )
            raise _CutFailed(reason, where) from None
        name, attribute, hook = hooked
        kind, shown = user_hooks.HOOK_KINDS[attribute], user_hooks.describe_hook(hook)
        where = f"`{name}`" if name else "the model itself"
        reason = (
            f"{reason} {IN_USER_HOOK}: the {kind} {shown} on {where}, which does not follow the cut widths"
        )
        raise _CutFailed(reason, name) from None
    if not trial.history:
        return NOTHING_TO_CUT
    return None


def _in_graph_build(error: BaseException) -> bool:
    """Whether ``error`` was raised by torch-pruning's own work while it built the dependency graph (its index
    mappings), not by the model's forward that the build runs (a cut width that breaks a reshape)."""
    frame, building = error.__traceback__, False
    while frame is not None:
        code = frame.tb_frame.f_code
        if code is build_dependency_graph.__code__:
            building = True
        elif building and code is call_with.__code__:
            return False
        frame = frame.tb_next
    return building


def _endless_search_on_streams(model: nn.Module) -> str | None:
    """Why the dependency search ran out of time on ``model``'s HyperConnection layers with more than one
    stream, or ``None`` without any. torch-pruning never ends that search: the layer's coefficient path
    projects the streams onto the concatenated ``phi`` maps and splits the projection in three, both of which
    it reads as channel-preserving, and each turn around that loop shifts the channel index by a split offset,
    so no turn repeats an earlier one (index 0 of a stream reached 300 of 8 channels within 2000 steps)."""
    layers = [
        name
        for name, part in model.named_modules()
        if isinstance(part, HyperConnection) and part.n_streams > 1
    ]
    if not layers:
        return None
    return (
        f"{ON_HYPER_CONNECTION_STREAMS} ({first_names(layers, 3)}), where it never ends: their coefficient "
        "path (the projection of the streams and its split into H_pre, H_post and H_res) sends the stream "
        "channels round a loop whose channel index grows at each turn"
    )


def _loss_in(output: Any) -> str | None:
    """Where ``output`` holds a loss: its ``loss`` entry (a Hugging Face output called with labels), or the
    output itself when it is one number; else ``None``."""
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return "`loss`"
    if isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point():
        return "a single number"
    return None


def _training_shapes(model: nn.Module, inputs: Any, cut: bool) -> list[tuple[int, ...]] | None:
    """The output shapes of ``model`` called in training mode (then back in eval mode). A branch that runs only
    in training (an auxiliary classifier behind ``if self.training``) is not in the eval-mode trace, and a cut
    that misses its input shows here. An error is raised for a ``cut`` model; for the uncut one it gives
    ``None``: the model does not run that way on the example, and the check stays with eval mode."""
    model.train()
    try:
        with torch.no_grad():
            _same_draws(model)
            return prune_targets.output_shapes(call_with(model, inputs))
    except Exception:
        if cut:
            raise
        return None
    finally:
        model.eval()


def _changed_function(
    uncut: nn.Module, names: Mapping[int, str], remap: ParameterRemap, inputs: Any, output: Any
) -> str | None:
    """Why the cut model no longer computes what the uncut one computes with the removed channels silenced,
    or ``None``.

    A correct cut equals the uncut model whose removed weights are zero: every element of a replaced
    parameter that the cut left out (producer rows, consumer columns, normalisation entries). A ``LayerNorm``
    over the cut width normalises the kept channels alone; the reference does the same. Anything else a cut
    changes is a wrong cut: a grouped convolution whose groups no longer line up, a ``GroupNorm`` whose groups
    take other channels, a reshape over the cut channels, a consumer the trace missed.

    Both models run from the same random state (:func:`_same_draws`, as ``output`` did): a forward that draws
    from torch's generators (ViTMAE's random patch mask, in eval mode too) draws the same numbers in both, and
    from the same buffers: what the first call writes in place (a fake quantizer's observer, in eval mode
    too) is given back (:func:`kept_buffers`), as the trial cut gives back what its trace wrote. A forward
    that differs between two calls of the uncut model even so is said to be not deterministic.
    """
    modules = dict(uncut.named_modules())
    parameters = dict(uncut.named_parameters())
    touched: dict[str, torch.Tensor] = {}  # module name -> the kept flat indices of its replaced weight
    for old, _, kept in remap:
        name = names.get(id(old))
        if name is None or name not in parameters:
            continue
        weight = parameters[name].data
        # `kept` counts elements in row-major order whatever the memory format: a mask of the weight's shape
        # silences them in place on a channels_last weight too, whose `.view(-1)` torch refuses
        silenced = torch.ones(weight.numel(), dtype=torch.bool, device=weight.device)
        silenced[kept.to(weight.device)] = False
        weight.masked_fill_(silenced.view(weight.shape), 0)
        owner, _, leaf = name.rpartition(".")
        if leaf == "weight":
            touched[owner] = kept
    handles = [
        modules[name].register_forward_hook(partial(_norm_over_kept, kept=kept))
        for name, kept in touched.items()
        if _renormalises(modules.get(name))
    ]
    again = None
    try:
        _same_draws(uncut)
        with kept_buffers(uncut):  # the second call starts where the first did (an observer's statistics)
            expected = _floating_tensors(call_with(uncut, inputs))
        moved = _largest_difference(_floating_tensors(output), expected)
        if moved is not None:
            _same_draws(uncut)
            again = _largest_difference(_floating_tensors(call_with(uncut, inputs)), expected)
    finally:
        for handle in handles:
            handle.remove()
    if moved is None:
        return None
    if again is not None:
        return (
            "cannot be checked: two calls of the uncut model on the same input, from the same state of "
            f"torch's random generators, differ by up to {again:.3g}, so its forward is not deterministic "
            "(it draws from a generator of its own, numpy's or Python's, writes a parameter of its own in "
            "forward, or uses a nondeterministic kernel), and what the cut model computes has nothing to be compared with; make the forward "
            "deterministic in eval mode (torch's global generators are fine), e.g. by passing its random "
            "inputs in the batch"
        )
    suspects = [
        name
        for name in touched
        if isinstance(modules.get(name), nn.GroupNorm) or getattr(modules.get(name), "groups", 1) > 1
    ]
    found = f" at {', '.join(f'`{name}`' for name in suspects[:3])}" if suspects else ""
    return (
        f"changes what the kept channels compute (the output moves by up to {moved:.3g} from the model "
        f"with the removed channels silenced): the cut does not follow this model's channel structure"
        f"{found}, as with grouped convolutions, GroupNorm, or a reshape over the cut channels; leave out "
        "the layers whose channels reach them"
    )


def _largest_difference(got: Sequence[torch.Tensor], wanted: Sequence[torch.Tensor]) -> float | None:
    """How far the tensors ``got`` are from ``wanted`` at most, or ``None`` when all are close."""
    for have, want in zip(got, wanted):
        scale = want.abs().max().item() if want.numel() else 0.0
        if not torch.allclose(have.float(), want.float(), rtol=1e-3, atol=1e-4 * max(scale, 1.0)):
            return (have.float() - want.float()).abs().max().item()
    return None


#: the seed every compared forward of the structured check starts from (:func:`_same_draws`)
CHECK_SEED = 0


def _cuda_devices(model: nn.Module) -> list[int]:
    """The CUDA devices that ``model``'s parameters and buffers are on."""
    tensors = (*model.parameters(), *model.buffers())
    return sorted({tensor.device.index or 0 for tensor in tensors if tensor.device.type == "cuda"})


def _same_draws(model: nn.Module) -> None:
    """Seed torch's CPU generator and those of ``model``'s CUDA devices with :data:`CHECK_SEED`, so that two
    forwards the check compares draw the same numbers. Called inside the check's ``fork_rng``: the run's own
    generators are untouched."""
    torch.default_generator.manual_seed(CHECK_SEED)
    for index in _cuda_devices(model):
        with torch.cuda.device(index):
            torch.cuda.manual_seed(CHECK_SEED)


def _renormalises(module: nn.Module | None) -> bool:
    """Whether ``module`` normalises over all its channels together, so that once cut it normalises the kept
    ones alone: a ``LayerNorm`` over the last dimension, a ``GroupNorm`` with one group."""
    if isinstance(module, nn.LayerNorm):
        return len(module.normalized_shape) == 1
    return isinstance(module, nn.GroupNorm) and module.num_groups == 1


def _norm_over_kept(module: nn.Module, args: Any, output: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    # what the normalisation cut to the kept channels computes, with the removed ones silenced (zero)
    index = kept.to(output.device)
    # Hugging Face's ConvNeXt keeps a LayerNorm over dimension 1 (``data_format="channels_first"``)
    channels_last = (
        isinstance(module, nn.LayerNorm) and getattr(module, "data_format", "") != "channels_first"
    )
    dim = -1 if channels_last else 1
    inputs = args[0].index_select(dim, index)
    weight = None if module.weight is None else module.weight.index_select(0, index)
    bias = None if module.bias is None else module.bias.index_select(0, index)
    if channels_last:
        normalised = F.layer_norm(inputs, (index.numel(),), weight, bias, module.eps)
    elif isinstance(module, nn.LayerNorm):  # over the channels alone, at every position
        moved = inputs.movedim(1, -1)
        normalised = F.layer_norm(moved, (index.numel(),), weight, bias, module.eps).movedim(-1, 1)
    else:
        normalised = F.group_norm(inputs, 1, weight, bias, module.eps)
    return torch.zeros_like(output).index_copy(dim, index, normalised)


def _floating_tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model output, in order (tensor, tuple/list, mapping, ``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, Mapping):
        return [t for value in output.values() for t in _floating_tensors(value)]
    if isinstance(output, (tuple, list)):
        return [t for value in output for t in _floating_tensors(value)]
    return []


def small_example(example: Any) -> Any:
    """Two samples of ``example`` on the CPU: enough to trace the graph, and tiny in a checkpoint. The checks
    and the events trace the example they are given as it is (:func:`as_traced`): this cut is made once, where
    the example is chosen (:func:`~lightning_pulse.core.prune_setup.structured_example`).

    The cut is along the batch dimension, as :func:`~lightning_pulse.core.selection.take_samples` cuts a
    batch: every tensor of ``B`` rows and every list or tuple of ``B`` per-sample items (a detection batch's
    list of target dicts) keeps its first two samples, and the items kept stay whole (their boxes are not cut
    again). ``B`` is the first dimension of the outermost tensor (:func:`_batch_rows`); other leaves are
    kept."""
    example = _plain_mappings(example)  # as the result's are; and a defaultdict is not rebuilt from items
    rows = _batch_rows(example)
    if rows is not None and rows > 2:
        example = take_samples(example, torch.arange(2), rows)
    return _detached_on_cpu(example)


def small_example_cuts(example: Any) -> bool:
    """Whether :func:`small_example` leaves out samples of ``example`` (it holds more than two)."""
    rows = _batch_rows(_plain_mappings(example))
    return rows is not None and rows > 2


def as_traced(example: Any) -> Any:
    """``example`` whole, as it is traced: its tensors detached on the CPU, its mappings plain dicts."""
    return _detached_on_cpu(_plain_mappings(example))


def runs_on(model: nn.Module, example: Any, precision: RunPrecision | None = None) -> bool:
    """Whether a copy of ``model`` (eval, its user hooks kept, no autograd) runs on ``example``; the run's
    random stream is left alone."""
    duplicate = copy_without_hooks(model, keep_user_hooks=True).eval()
    with torch.random.fork_rng(devices=_cuda_devices(duplicate)), torch.no_grad():
        try:
            call_with(duplicate, inputs_for(duplicate, as_traced(example), precision))
        except Exception:  # the question asked is only whether it runs
            return False
    return True


def _plain_mappings(example: Any) -> Any:
    """``example`` with every mapping a plain dict; tensors and other containers as they are."""
    if isinstance(example, Mapping):
        return {key: _plain_mappings(value) for key, value in example.items()}
    if isinstance(example, tuple) and hasattr(example, "_fields"):  # named tuple
        return type(example)(*(_plain_mappings(item) for item in example))
    if isinstance(example, (list, tuple)):
        return type(example)(_plain_mappings(item) for item in example)
    return example


def _batch_rows(example: Any) -> int | None:
    """The batch size of ``example``: the first dimension of its outermost tensor (the first one found at the
    least nesting: a detection batch's images, not the boxes inside its per-image target dicts), or
    ``None``."""
    level = [example]
    while level:
        tensors = [item for item in level if isinstance(item, torch.Tensor) and item.dim()]
        if tensors:
            return int(tensors[0].shape[0])
        level = [
            value
            for item in level
            if isinstance(item, (Mapping, list, tuple))
            for value in (item.values() if isinstance(item, Mapping) else item)
        ]
    return None


def _detached_on_cpu(example: Any) -> Any:
    """``example`` with its tensors detached, on the CPU and copied, its mappings plain dicts (what a
    checkpoint loaded with ``weights_only=True`` takes)."""
    if isinstance(example, torch.Tensor):
        return example.detach().cpu().clone()
    if isinstance(example, tuple) and hasattr(example, "_fields"):  # named tuple
        return type(example)(*(_detached_on_cpu(item) for item in example))
    if isinstance(example, (list, tuple)):
        return type(example)(_detached_on_cpu(item) for item in example)
    if isinstance(example, Mapping):
        return {key: _detached_on_cpu(value) for key, value in example.items()}
    return example


# ---------------------------------------------------------------------------------------------- the event
@dataclass
class PruneOutcome:
    """What one :meth:`Pruner.prune` call reached.

    Attributes:
        sparsity: share of the chosen weights (unstructured) or original channels (structured) now gone.
        layer_sparsity: the same per layer; structured: every chosen layer whose output channels a cut has
            removed, whether it leads the channel group or is cut within another layer's (a residual block's
            output layer, cut with the stream's other writers; Llama's ``gate_proj`` with ``up_proj``).
        remap: parameters replaced (structured; empty otherwise).
        problems: optimizer states that could not be cut and were reset, as messages.
        weight_share: share of the model's parameter elements held by the pruned layers' weights (before the
            event).
        uncut: structured: the chosen layers none of whose output channels has been cut (a layer applied
            twice, a layer whose outputs feed one of those, the output layer).
        narrowed: those of ``uncut`` whose weights another layer's group has cut, in this event or an earlier
            one (the input columns of a layer reading cut channels).
        removed_share: share of the whole model's parameters removed so far: masked (unstructured) or gone
            since before the first event (structured: the chosen layers' and every coupled module's, an
            embedding or a norm included); ``None`` when unknown (a checkpoint from before it was kept).
        left_out: chosen layers this event could not cut or mask although an earlier one did (or the fit
            start chose them), with why: a parametrization registered on them or on a layer they are cut
            with since then. They are in ``uncut`` too.
        untraced: structured: those of ``uncut`` that the trace input did not reach this event
            (:attr:`StructuredResult.untraced`): an expert its router did not send the two traced samples to.
    """

    sparsity: float
    layer_sparsity: dict[str, float]
    remap: ParameterRemap
    problems: list[str]
    weight_share: float = 0.0
    uncut: list[str] = field(default_factory=list)
    narrowed: list[str] = field(default_factory=list)
    removed_share: float | None = None
    left_out: dict[str, str] = field(default_factory=dict)
    untraced: list[str] = field(default_factory=list)


def masked_parameter_count(model: nn.Module) -> int:
    """How many weight elements of ``model`` a pruning mask zeroes (a weight shared by several layers counts
    once)."""
    masks = {
        id(module.weight_orig): mask
        for module in model.modules()
        if (mask := current_mask(module)) is not None
    }
    return sum(int(mask.numel() - torch.count_nonzero(mask)) for mask in masks.values())


class Pruner:
    """A pruning event on any ``nn.Module``: masks or removes channels down to an absolute target, and
    remembers what it removed so that a fresh module can be rebuilt to the same shapes.

    Args:
        mode: ``"unstructured"`` (``torch.nn.utils.prune`` masks on ``|w|``) or ``"structured"`` (output
            channels removed with torch-pruning, ranked by their group L2 norm).
        layer_types: layer classes, ``torch.nn`` names or dotted paths to prune; ``None`` for any layer with a
            ``weight`` (structured: not the per-channel scales of
            :func:`~lightning_pulse.core.prune_targets.scales_channels`).
        exclude_pattern: never layers whose qualified name matches this regex (``re.search``).
        ranking: ``"layer"`` (every layer reaches the target) or ``"global"`` (all chosen layers together).
        min_channels: structured: channels every layer keeps at least.

    Raises:
        ValueError: naming the field, for an unknown ``mode``/``ranking``, a bad layer type or regex.
        ModuleNotFoundError: structured mode without torch-pruning installed.

    Attributes:
        original_channels: structured: root layer name -> its channels before any pruning.
        layer_channels: structured: every chosen layer's output channels before any pruning, by name (a layer
            cut within another layer's group is reported with its real sparsity).
        original_params: structured: the model's parameter elements before the first event (``None`` before
            it, or from a checkpoint that did not keep it).
        history: structured: torch-pruning's history of every removal, in order.
        history_events: structured: how many :attr:`history` entries each event that cut added, in order
            (each event traced its own graph, which :func:`replay_structure` traces again).
        example_inputs: structured: the input the model is traced with (saved in checkpoints): two samples,
            or the user's whole ``example_input_array`` where its cut does not run
            (:func:`~lightning_pulse.core.prune_setup.structured_example`).
        run_precision: structured: how the run's precision plugin hands a batch over, set at fit
            start (:func:`inputs_for`); ``None`` outside a fit: guessed from the model's parameters.
        trace_dead_branches: structured: every trace also hands torch-pruning the outputs of the layers the
            forward runs and discards (:func:`build_dependency_graph`); set at fit start by
            :func:`check_structured` where only that trace's trial cut passes, saved in checkpoints.
    """

    def __init__(
        self,
        mode: str = "unstructured",
        layer_types: Sequence[str | type] | None = DEFAULT_LAYER_TYPES,
        exclude_pattern: str | None = None,
        ranking: str = "layer",
        min_channels: int = 1,
    ) -> None:
        for name, value, allowed in (("mode", mode, MODES), ("ranking", ranking, RANKINGS)):
            if value not in allowed:
                raise ValueError(f"`{name}`={value!r} is not one of {list(allowed)}.")
        if isinstance(min_channels, bool) or not isinstance(min_channels, int) or min_channels < 1:
            raise ValueError(f"`min_channels`={min_channels!r} must be an int >= 1.")
        if exclude_pattern is not None:
            try:
                re.compile(exclude_pattern)
            except (re.error, TypeError) as error:
                raise ValueError(
                    f"`exclude_pattern`={exclude_pattern!r} is not a valid regular expression: {error}."
                ) from None
        if mode == "structured":
            import_torch_pruning()
        self.mode, self.ranking, self.min_channels, self.exclude_pattern = (
            mode,
            ranking,
            min_channels,
            exclude_pattern,
        )
        self.layer_types = resolve_layer_types(layer_types)
        self.original_channels: dict[str, int] = {}
        self.layer_channels: dict[str, int] = {}
        self.original_params: int | None = None
        self.history: list[list[Any]] = []
        self.history_events: list[int] = []
        self.example_inputs: Any = None
        #: structured: the chosen layers whose weights a cut has replaced (narrowed), by name
        self.narrowed: set[str] = set()
        #: layers the user froze (set at the fit's setup): never pruned
        self.user_frozen: frozenset[str] = frozenset()
        #: layers whose forward was seen reading another ``weight`` than their own, with why: never pruned
        #: (:class:`~lightning_pulse.core.prune_targets.OwnWeightWatch`)
        self.not_trained: dict[str, str] = {}
        self.run_precision: RunPrecision | None = None
        self.trace_dead_branches = False

    def for_trial(
        self,
        layer_types: Sequence[str | type] | None = None,
        exclude_pattern: Any = ...,  # ...: this pruner's (None is a pattern given: none)
        min_channels: int | None = None,
    ) -> Pruner:
        """A structured pruner for a trial cut on a copy: this one's layer types, ``exclude_pattern`` and
        ``min_channels`` unless given, its ranking, and the run's layers it leaves alone (user-frozen, not
        trained) and precision; none of its history."""
        trial = Pruner(
            "structured",
            layer_types
            if layer_types is not None
            else self.layer_types or None,  # `()` was resolved from None
            self.exclude_pattern if exclude_pattern is ... else exclude_pattern,
            self.ranking,
            self.min_channels if min_channels is None else min_channels,
        )
        trial.user_frozen, trial.run_precision = self.user_frozen, self.run_precision
        trial.not_trained = dict(self.not_trained)
        trial.trace_dead_branches = self.trace_dead_branches
        return trial

    def selection(self, model: nn.Module) -> LayerSelection:
        """The layers of ``model`` this pruner prunes, and those it leaves out with the reason."""
        return prune_targets.select_targets(
            model,
            self.layer_types,
            self.exclude_pattern,
            structured=self.mode == "structured",
            frozen=self.user_frozen,
            not_trained=self.not_trained,
        )

    def layers(self, model: nn.Module) -> dict[str, nn.Module]:
        """The layers of ``model`` this pruner prunes, by qualified name."""
        return self.selection(model).layers

    def prune(
        self,
        model: nn.Module,
        sparsity: float,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        example: Any = None,
    ) -> PruneOutcome:
        """Bring the chosen layers of ``model`` to ``sparsity``; pruned weights or channels stay pruned.

        Structured: ``example`` (a model input; two samples are kept) traces the model the first time, and
        every optimizer's parameters and state are moved onto the replaced parameters in place.
        """
        selection = self.selection(model)
        layers = selection.layers
        if self.mode == "unstructured":
            # owners of one tied weight share the mask of the first of them
            primaries = selection.primaries
            keep_written_weights(primaries.values())  # a write since the last forward counts in the ranking
            scores = {name: effective_weight(module).abs() for name, module in primaries.items()}
            previous = {name: current_mask(module) for name, module in primaries.items()}
            masks = unstructured_masks(scores, sparsity, self.ranking, previous)
            masks.update({alias: masks[primary] for alias, primary in selection.aliases.items()})
            share = prune_targets.weight_share(model, layers)
            apply_masks(layers, masks)
            removed = masked_parameter_count(model) / max(sum(p.numel() for p in model.parameters()), 1)
            return PruneOutcome(
                global_sparsity(primaries),
                layer_sparsity(layers),
                ParameterRemap(),
                [],
                share,
                removed_share=removed,
            )
        # the share is of the layers this event really cuts, known only after it: their weights' sizes before it
        sizes = prune_targets.weight_shares(model, layers)
        if self.original_params is None and not self.history:  # the first event: nothing cut yet
            self.original_params = sum(parameter.numel() for parameter in model.parameters())
        if not self.history:  # uncut yet: a layer first counted after a cut (a resume) has no known original
            for name, count in channel_counts(model, list(layers)).items():
                self.layer_channels.setdefault(name, count)
        if self.example_inputs is None:
            if example is None:
                raise ValueError("Structured pruning needs an example input to trace the model with.")
            self.example_inputs = small_example(example)
        result = prune_channels(
            model,
            self.example_inputs,
            layers,
            sparsity,
            self.original_channels,
            self.ranking,
            self.min_channels,
            self.run_precision,
            self.user_frozen,
            self.trace_dead_branches,
        )
        self.history.extend(result.history)
        if result.history:
            self.history_events.append(len(result.history))
        problems = []
        if len(result.remap):
            names = {id(parameter): name for name, parameter in model.named_parameters()}
            for optimizer in optimizers_within([*optimizers, *module_optimizers(model)]):
                problems += remap_optimizer_state(optimizer, result.remap, names)
        # a chosen layer whose outputs were cut within another layer's group is cut, not "left uncut"
        originals = {**self.layer_channels, **self.original_channels}
        counts = channel_counts(model, list(originals))
        cut = {
            name: channels
            for name, channels in originals.items()
            if name in self.original_channels or counts.get(name, channels) < channels
        }
        reached, per_layer = channel_sparsity(counts, cut)
        share = sum(sizes.get(name, 0.0) for name in per_layer)
        removed = None
        if self.original_params:
            removed = 1.0 - sum(parameter.numel() for parameter in model.parameters()) / self.original_params
        replaced = {id(new) for _, new, _ in result.remap}
        self.narrowed |= {
            name
            for name, module in layers.items()
            if any(id(parameter) in replaced for parameter in module._parameters.values())
        }
        uncut = [name for name in layers if name not in per_layer]
        narrowed = [name for name in uncut if name in self.narrowed]
        # a root an earlier event cut whose group cannot be cut now: the model changed since (a
        # parametrization on it or on a layer it is cut with); unnamed, it held the run below the target
        named = dict(model.named_modules())
        # (not a root the trace did not reach this time: an expert its router sent no traced sample to)
        lost = [
            name
            for name in self.original_channels
            if name in named and name not in result.roots and name not in result.untraced
        ]
        left_out = {name: why_left_out(name, selection, model, result.blocked) for name in lost}
        uncut += [name for name in lost if name not in uncut]
        outcome = PruneOutcome(reached, per_layer, result.remap, problems, share, uncut, narrowed, removed)
        outcome.left_out = left_out
        outcome.untraced = [name for name in uncut if name in result.untraced]
        return outcome

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [list(entry) for entry in self.history],
            "history_events": list(self.history_events),
            "original_channels": dict(self.original_channels),
            "example_inputs": self.example_inputs,
            "narrowed": sorted(self.narrowed),
            "layer_channels": dict(self.layer_channels),
            "original_params": self.original_params,
            "not_trained": dict(self.not_trained),
            "trace_dead_branches": self.trace_dead_branches,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = [list(entry) for entry in state["history"]]
        # a checkpoint from before the events were told apart replayed its history on one graph: as one event
        events = state.get("history_events")
        self.history_events = [int(n) for n in events] if events is not None else [len(self.history)]
        self.original_channels = dict(state["original_channels"])
        self.example_inputs = state["example_inputs"]
        self.narrowed = set(state.get("narrowed", ()))  # a checkpoint from before it was kept: none known
        # from before they were kept: the roots' originals only, and the model's size before the cuts unknown
        self.layer_channels = dict(state.get("layer_channels", self.original_channels))
        self.original_params = state.get("original_params")
        self.not_trained = dict(state.get("not_trained", {}))
        # from before it was kept: the ordinary trace, the only one there was
        self.trace_dead_branches = bool(state.get("trace_dead_branches", False))


def why_left_out(
    name: str, selection: LayerSelection, model: nn.Module, blocked: Mapping[str, list[str]] | None = None
) -> str:
    """Why the chosen layer ``name`` of ``model`` cannot be pruned now (it is left out of ``selection``, or
    its channel group is ``blocked`` by the computed weight of the modules named there), with the call that
    lets it be pruned where a parametrization is the cause."""
    if name in selection.left_out:
        reason = selection.left_out[name]
        if reason != prune_targets.COMPUTED_WEIGHT:
            return reason
        computing = [name]
    elif blocked and blocked.get(name):
        computing = blocked[name]
        reason = f"it is cut with {first_names(computing, 3)}, whose weight is computed by a parametrization"
    else:
        return "no channel group of its can be cut safely any more"
    removals: dict[str, list[str]] = {}
    for module in computing:
        removals.setdefault(prune_targets.weight_computation_removal(model.get_submodule(module)), []).append(
            module
        )
    calls = "; ".join(f"`{call}` for {first_names(names, 3)}" for call, names in removals.items())
    return f"{reason}, which a cut or a mask cannot follow (removed with {calls})"


def event_record(
    step: int,
    target: float,
    outcome: PruneOutcome,
    model: nn.Module,
    probe_before: Mapping[str, float] | None = None,
    probe_after: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The record of one event: step, target and reached sparsity, per-layer sparsity, parameter counts
    (:func:`count_parameters`) and the probe metrics before and after."""
    return {
        "step": int(step),
        "target_sparsity": target,
        "sparsity": outcome.sparsity,
        "layer_sparsity": dict(outcome.layer_sparsity),
        "weight_share": float(outcome.weight_share),
        "uncut_layers": list(outcome.uncut),
        "left_out_layers": list(outcome.left_out),
        "untraced_layers": list(outcome.untraced),
        "narrowed_layers": list(outcome.narrowed),
        "params_removed_share": outcome.removed_share,
        **count_parameters(model),
        "probe_before": None if probe_before is None else dict(probe_before),
        "probe_after": None if probe_after is None else dict(probe_after),
    }


def event_metrics(event: Mapping[str, Any], unlogged: Collection[str] = ()) -> dict[str, float]:
    """An :func:`event_record` as flat ``prune/...`` metrics for a logger; the probe figures named in
    ``unlogged`` (logged by the module with ``logger=False``) are left out."""
    metrics = {
        "prune/target_sparsity": float(event["target_sparsity"]),
        "prune/sparsity": float(event["sparsity"]),
        "prune/params": float(event["params"]),
        "prune/params_nonzero": float(event["params_nonzero"]),
    }
    if event.get("params_removed_share") is not None:
        metrics["prune/params_removed_share"] = float(event["params_removed_share"])
    metrics.update({f"prune/layer/{name}": value for name, value in event["layer_sparsity"].items()})
    for when in ("before", "after"):
        metrics.update(
            {
                f"prune/{name}_{when}": value
                for name, value in (event[f"probe_{when}"] or {}).items()
                if name not in unlogged
            }
        )
    return metrics


def event_summary(event: Mapping[str, Any]) -> str:
    """One line on an :func:`event_record`."""

    def probe(values: Mapping[str, float] | None) -> str:
        return ", ".join(f"{name}={value:.4f}" for name, value in sorted(values.items())) if values else "n/a"

    text = (
        f"step {event['step']}: sparsity {event['sparsity']:.3f} (target {event['target_sparsity']:.3f}) over "
        f"{len(event['layer_sparsity'])} layers holding {event.get('weight_share', 0.0):.0%} of the model's "
        "weights"
    )
    if event.get("params_removed_share") is not None:  # the cut's whole reach: coupled norms, inputs, tables
        text += f" ({event['params_removed_share']:.0%} of the model's parameters removed so far)"
    text += f", {event['params_nonzero']} of {event['params']} parameters non-zero"
    if event["probe_after"]:
        text += f", {probe(event['probe_before'])} -> {probe(event['probe_after'])}"
    narrowed = event.get("narrowed_layers") or []
    left_out = event.get("left_out_layers") or []
    untraced = [name for name in event.get("untraced_layers") or [] if name not in narrowed + left_out]
    uncut = [
        name
        for name in event.get("uncut_layers") or []
        if name not in narrowed and name not in left_out and name not in untraced
    ]
    if left_out:
        text += (
            f"; chosen but no longer pruned (the model changed since, said in a warning): {_some(left_out)}"
        )
    if uncut:
        text += f"; left uncut, no channel group of theirs can be cut safely: {_some(uncut)}"
    if untraced:  # an expert its router did not send the two traced samples to: not seen, not judged unsafe
        text += (
            "; left uncut this event, not reached by the traced input (called depending on the data, as an "
            f"expert behind a router, or their output unused): {_some(untraced)}"
        )
    if narrowed:
        text += (
            "; narrowed only by another layer's cut (no channel group of theirs can be cut safely; compare "
            f"their shapes): {_some(narrowed)}"
        )
    return text


def _some(names: Sequence[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


# ---------------------------------------------------------------------------------------------- resume
Structure = Mapping[str, Any]  # a Pruner's state_dict: "history" and "example_inputs"


def fit_to_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    prefix: str = "",
    structure: Structure | Callable[[], Structure | None] | None = None,
    precision: RunPrecision | None = None,
) -> None:
    """Make a freshly built ``module`` fit a state dict saved from a pruned one, before it loads.

    Creates the parameters its lazy modules (``nn.LazyLinear``) have not created yet
    (:func:`create_lazy_tensors`), adds a mask to every layer with a ``*.weight_mask`` entry and, when shapes
    differ, replays the channel removals recorded in ``structure`` (a :class:`Pruner`'s state dict, or a
    function returning it, asked only then or for a lazy module). ``precision``: in a fit that restores the
    module, the run's (:attr:`Pruner.run_precision`); read under ``32-true`` and the mixed precisions only
    (an ``input_dtype`` of float32), whose plugins convert neither the module nor a batch. Otherwise the trace
    input follows the module's own dtype (:func:`inputs_for` without one): a true-precision plugin converts
    the module only after Lightning restored it. A write to a masked layer's computed weight not yet kept is
    dropped (:func:`discard_written_weights`): the state loaded now supersedes it.

    When ``structure`` records no removals (a weights-only checkpoint), the widths are read from the state
    dict's shapes instead (:func:`~lightning_pulse.core.prune_widths.fit_widths`): every value is loaded, so
    which channels the fresh module keeps does not matter. So they are where the replay cannot follow the run
    (:func:`replay_structure`: a router sends the recorded input to other experts in the fresh module) or its
    shapes are not the saved ones (a history recorded before its events were told apart).

    Raises:
        RuntimeError: the module lost channels since the state was saved, or a layer's widths differ and
            neither ``structure`` nor its shapes tell them
            (:func:`~lightning_pulse.core.prune_widths.fit_widths`).
    """
    discard_written_weights(module)  # the state loaded now supersedes a write to a computed weight before it
    keys = [key[len(prefix) :] for key in state_dict if key.startswith(prefix)]
    trace_precision = precision if precision is not None and precision.input_dtype == torch.float32 else None
    recorded = None
    if any(nn.parameter.is_lazy(tensor) for tensor in (*module.parameters(), *module.buffers())):
        recorded = structure() if callable(structure) else structure
        cut = recorded is not None and bool(recorded.get("history"))
        example = _example_in_module_dtype(module, state_dict, prefix, keys, recorded) if cut else None
        create_lazy_tensors(module, state_dict, prefix, example, trace_precision)
    for key in keys:
        if key.endswith(".weight_mask"):
            try:
                layer = module.get_submodule(key[: -len(".weight_mask")])
            except AttributeError:
                continue
            if "weight" in layer._parameters:
                add_mask(layer)
    # a buffer of a module holding no parameter (a batch statistic it resizes on load) is no cut's: left to the
    # load (first in the state dict, it was read as channels lost since the save)
    mismatched = [
        key for key in _shapes_to_fit(module, state_dict, prefix, keys) if _cut_could_narrow(module, key)
    ]
    if not mismatched:
        return
    key = mismatched[0]
    saved, current = tuple(state_dict[prefix + key].shape), tuple(module.state_dict()[key].shape)
    if math.prod(saved) > math.prod(current):
        # the module lost channels after the state was saved (a best checkpoint from before a cut): no record of
        # removals can give them back to this module object
        raise RuntimeError(
            f"ScheduledPrune: the state dict holds the model from before channels were cut ({key}: {saved} there, "
            f"{current} in this module, which was cut since), and a module cannot take removed channels back. Load "
            "it into a freshly built module with ScheduledPrune.load_pruned(YourModule(...), checkpoint), which "
            "redoes the cuts the checkpoint records (YourModule.load_from_checkpoint(path) works only for a "
            "checkpoint from before the first cut), or evaluate the cut model itself: "
            "trainer.test(ckpt_path=None), or ckpt_path='last' only where that checkpoint was saved "
            "after the cut (ModelCheckpoint(monitor=...) rewrites last.ckpt only with a top-k save, so it "
            "can be this same pre-cut one)."
        )
    if recorded is None:
        recorded = structure() if callable(structure) else structure
    if not recorded or not recorded.get("history"):
        # a weights-only checkpoint: its values are all loaded, so only the widths (its shapes) matter
        prune_widths.fit_widths(module, state_dict, prefix)
        return
    example = _example_in_module_dtype(module, state_dict, prefix, keys, recorded)
    events = recorded.get("history_events")
    dead_branches = bool(recorded.get("trace_dead_branches", False))
    unreplayed = replay_structure(
        module, example, recorded["history"], trace_precision, events, dead_branches
    )
    if unreplayed is None and not any(
        prune_widths.sets_widths_of(module.get_submodule(key.rpartition(".")[0]))
        for key in _shapes_to_fit(module, state_dict, prefix, keys)
    ):
        # a full replay: a shape it leaves different is no cut layer's (a buffer its module resizes on load),
        # the load's to handle, as before the events were told apart
        return
    # every value is loaded next, so the widths (the saved shapes) are all a replay that cannot follow the run
    # has to give: a router's experts, or a history recorded before its events were told apart (one graph)
    prune_widths.fit_widths(
        module, state_dict, prefix, unreplayed or "the replayed cuts do not give the saved shapes"
    )


def _shapes_to_fit(
    module: nn.Module, state_dict: Mapping[str, Any], prefix: str, keys: Sequence[str]
) -> list[str]:
    """The ``keys`` (without ``prefix``) whose saved tensor has another shape than ``module``'s entry."""
    own = module.state_dict()
    return [
        key
        for key in keys
        if key in own
        and isinstance(state_dict[prefix + key], torch.Tensor)
        and not nn.parameter.is_lazy(own[key])  # no entry to create it from: load_state_dict says so
        and own[key].shape != state_dict[prefix + key].shape
        and not _resized_on_load(module, key)
    ]


def _cut_could_narrow(module: nn.Module, key: str) -> bool:
    """Whether the state entry ``key`` is one a channel cut changes: a parameter, or a buffer of a module that
    holds parameters (a batch norm's running statistics), not a buffer of a parameter-free module."""
    owner_name, _, name = key.rpartition(".")
    try:
        owner = module.get_submodule(owner_name)
    except AttributeError:
        return True
    return name in owner._parameters or bool(owner._parameters)


def _resized_on_load(module: nn.Module, key: str) -> bool:
    """Whether the module owning the state entry ``key`` resizes it to the saved shape as it loads: torch.ao's
    fake quantizers and observers, whose per-channel ``scale`` / ``min_val`` are ``(1,)`` until their first
    forward. No cut made those shapes differ (a QAT model's resume was refused as if channels had been cut)."""
    from torch.ao.quantization import FakeQuantizeBase
    from torch.ao.quantization.observer import ObserverBase

    owner_name = key.rpartition(".")[0]
    try:
        owner = module.get_submodule(owner_name)
    except AttributeError:
        return False
    return isinstance(owner, (FakeQuantizeBase, ObserverBase))


def _example_in_module_dtype(
    module: nn.Module, state_dict: Mapping[str, Any], prefix: str, keys: Sequence[str], recorded: Structure
) -> Any:
    """The recorded trace input, its tensors of the state dict's floating dtype in the fresh module's."""
    own = module.state_dict()  # a lazy entry has its dtype already
    example = recorded["example_inputs"]
    floating = (
        (state_dict[prefix + key].dtype, own[key].dtype)
        for key in keys
        if isinstance(state_dict[prefix + key], torch.Tensor)
        and isinstance(own.get(key), torch.Tensor)
        and own[key].is_floating_point()
    )
    saved_dtype, module_dtype = next(floating, (None, None))
    if saved_dtype == module_dtype:
        return example
    # Lightning restores the module before a true-precision plugin converts it: the example's tensors that
    # plugin converted to the checkpoint's dtype go back to the fresh module's (64-true: float64 to float32,
    # which inputs_for does not do: a float32 model may take a float64 tensor on purpose)
    return apply_to_collection(
        example, torch.Tensor, lambda x: x.to(module_dtype) if x.dtype == saved_dtype else x
    )


def create_lazy_tensors(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    prefix: str = "",
    example: Any = None,
    precision: RunPrecision | None = None,
) -> None:
    """Create the parameters and buffers that the lazy modules (``nn.LazyLinear``) of a freshly built ``module``
    have not created yet, so that a pruned state dict can be fitted to it. torch's own load hook creates them
    only as each lazy module loads, after :func:`fit_to_state_dict` needed their shapes.

    With ``example`` (a structured run's recorded trace input) ``module`` runs it once, in eval mode and without
    gradients: that creates them at their uncut shapes, which the recorded removals start from (the saved
    shapes are the cut ones, and a cut of the layer before a lazy one changes its input size too). Any still
    lazy then (a module the forward does not call, so never cut) takes the shape of its saved entry, or of the
    ``*_orig`` entry of a masked weight: an unstructured run changes no shape. One without an entry stays lazy.
    """
    if example is not None:
        modes = {part: part.training for part in module.modules()}
        module.eval()
        tensors = (*module.parameters(), *module.buffers())
        devices = sorted({tensor.device.index or 0 for tensor in tensors if tensor.device.type == "cuda"})
        # loading must not change the run that loads: lazy layers initialise from forked generators
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                call_with(module, inputs_for(module, example, precision))
        finally:
            for part, training in modes.items():
                part.train(training)
    for owner_name, owner in module.named_modules():
        for name, tensor in (*owner._parameters.items(), *owner._buffers.items()):
            if tensor is None or not nn.parameter.is_lazy(tensor):
                continue
            key = f"{prefix}{owner_name}.{name}" if owner_name else f"{prefix}{name}"
            saved = state_dict.get(key, state_dict.get(f"{key}_orig"))
            if isinstance(saved, torch.Tensor) and not nn.parameter.is_lazy(saved):
                tensor.materialize(saved.shape)


def load_pruned(
    module: nn.Module,
    checkpoint: str | os.PathLike | Mapping[str, Any],
    state_key: str = "ScheduledPrune",
    weights_only: bool = True,
) -> nn.Module:
    """Load a Lightning ``checkpoint`` (a dict, or the path of a checkpoint file, loaded on the CPU) into a
    freshly built ``module``, fitting it first with the structure recorded in the callback state whose key
    starts with ``state_key``. Returns ``module``.

    A file is read with ``torch.load(..., weights_only=weights_only)``: by default torch's safe loader, which
    every lightning-pulse checkpoint passes (tensors, numbers, strings, lists and dicts only); it read every
    file with ``weights_only=False`` before, so a file with a pickled object ran its code. Pass
    ``weights_only=False`` only for a file you trust that holds other objects (your own callback's state)."""
    if not isinstance(checkpoint, Mapping):
        checkpoint = torch.load(checkpoint, map_location="cpu", weights_only=weights_only)
    callbacks = checkpoint.get("callbacks", {})
    structure = next((value for key, value in callbacks.items() if str(key).startswith(state_key)), None)
    fit_to_state_dict(module, checkpoint["state_dict"], structure=structure)
    module.load_state_dict(checkpoint["state_dict"])
    # `layer.weight` shows the loaded weights before any forward (it held the fresh module's initial values)
    refresh_masked_weights(masked_weights(module), grad=False)
    return module


class StateDictFitter:
    """``load_state_dict`` pre-hook running :func:`fit_to_state_dict` with the structure that ``structure()``
    returns when asked (e.g. read from the checkpoint being restored), and the run's :class:`RunPrecision`
    that ``precision()`` returns (``None``: none known). ``before`` (optional) is called first with the
    module, still as built, the state dict, the prefix, the structure and the run precision.

    Holds bound functions weakly, and is neither deep-copied nor pickled with the module (a copy of the
    module would otherwise drag the owner, and through it a Trainer, along).
    """

    def __init__(
        self,
        structure: Callable[[], Structure | None],
        precision: Callable[[], RunPrecision | None] | None = None,
        before: Callable[..., None] | None = None,
    ) -> None:
        self._structure = _held_weakly(structure)
        self._precision = _held_weakly(precision)
        self._before = _held_weakly(before)

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        structure, precision, before = self._structure(), self._precision(), self._before()
        if structure is not None:
            run_precision = precision() if precision is not None else None
            if before is not None:
                before(module, state_dict, prefix, structure, run_precision)
            fit_to_state_dict(module, state_dict, prefix, structure, run_precision)

    def __deepcopy__(self, memo: dict[int, Any]) -> StateDictFitter:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy keeps a hook doing nothing that plain torch resolves without lightning_pulse (a model saved
        # whole mid-fit, loaded where the library is not installed): a bound `"".format`, which takes the
        # hook's arguments and formats none of them.
        return (getattr, ("", "format"))


def _held_weakly(function: Callable[..., Any] | None) -> Callable[[], Any]:
    """A function returning ``function``; a bound method is held weakly (``None`` once its owner is gone)."""
    return weakref.WeakMethod(function) if hasattr(function, "__self__") else lambda: function


def _inert_hook(*args: Any) -> Callable[..., None]:
    # what earlier versions pickled the fitter as: whole-module pickles saved by them still name it
    return _do_nothing


def _do_nothing(*args: Any) -> None:
    return None
