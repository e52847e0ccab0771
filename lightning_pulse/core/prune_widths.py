"""Fit a freshly built module to the widths of a structured run's state dict, read from its shapes alone.

A weights-only checkpoint (``ModelCheckpoint(save_weights_only=True)``) of a
:class:`~lightning_pulse.ScheduledPrune` run in structured mode holds the cut weights but not the record of
which channels were removed. None is needed to load it: every value comes from the state dict, so which
channels the fresh module keeps does not matter, only how many. :func:`fit_widths` gives each layer whose
entries have other shapes tensors of the saved shapes and sets the attributes its ``forward`` reads
(``out_features``, ``in_channels``, ``num_features``, ...). A layer whose width lives elsewhere (a grouped
convolution, an attention block) cannot be fitted so; it is named, with the way out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_pulse.core import prune_targets

#: the way out named when a layer's widths cannot be read from its shapes
FULL_CHECKPOINT = (
    "save the run's checkpoints with ModelCheckpoint(save_weights_only=False) (the default), which records "
    "the channel removals ScheduledPrune.load_pruned replays"
)


def _linear(module: nn.Linear, weight: torch.Tensor) -> None:
    module.out_features, module.in_features = weight.shape


def _hf_conv1d(module: nn.Module, weight: torch.Tensor) -> None:
    module.nf = weight.shape[1]  # Hugging Face's Conv1D stores (in, out); its forward reads `nf`


def _conv(module: nn.modules.conv._ConvNd, weight: torch.Tensor) -> None:
    first, second = weight.shape[0], weight.shape[1] * module.groups
    module.in_channels, module.out_channels = (first, second) if module.transposed else (second, first)


def _norm(module: nn.Module, weight: torch.Tensor) -> None:
    module.num_features = weight.shape[0]


def _layer_norm(module: nn.LayerNorm, weight: torch.Tensor) -> None:
    module.normalized_shape = tuple(weight.shape)


def _group_norm(module: nn.GroupNorm, weight: torch.Tensor) -> None:
    module.num_channels = weight.shape[0]


def _embedding(module: nn.Embedding, weight: torch.Tensor) -> None:
    module.num_embeddings, module.embedding_dim = weight.shape


def _prelu(module: nn.PReLU, weight: torch.Tensor) -> None:
    module.num_parameters = weight.numel()


def memory_format_of(tensor: torch.Tensor) -> torch.memory_format:
    """The memory format ``tensor`` is laid out in, to give a cut or resized copy of it the same layout: a
    model moved to ``channels_last`` stays so after its channels are cut (torch-pruning's ``index_select``
    returns a contiguous tensor). A tensor laid out both ways (a ``(C, 1, 1, 1)`` weight) reads as
    contiguous; one of any other strides too."""
    if tensor.is_contiguous():
        return torch.contiguous_format
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if tensor.dim() == 5 and tensor.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def drop_gradient_accumulator(parameter: nn.Parameter) -> None:
    """Let autograd forget ``parameter``'s gradient accumulator before its data takes another shape.

    The accumulator keeps the old shape and checks every gradient against it; torch drops it (the next
    backward makes one of the new shape, with the parameter's hooks) only when the dtype of the data changes.
    The passing dtype is float16, or float32 for a float16 parameter: every device has both (MPS has no
    float64)."""
    other = torch.float16 if parameter.dtype != torch.float16 else torch.float32
    parameter.data = torch.empty(0, dtype=other, device=parameter.device)


_WIDTHS: tuple[tuple[Callable[[nn.Module], bool], Callable[[Any, torch.Tensor], None]], ...] = (
    (lambda m: isinstance(m, nn.Linear), _linear),
    (prune_targets.is_hf_conv1d, _hf_conv1d),
    (lambda m: isinstance(m, nn.modules.conv._ConvNd) and m.groups == 1, _conv),
    (lambda m: isinstance(m, (nn.modules.batchnorm._NormBase)), _norm),
    (lambda m: isinstance(m, nn.LayerNorm) and m.elementwise_affine, _layer_norm),
    (lambda m: isinstance(m, nn.GroupNorm) and m.affine, _group_norm),
    (lambda m: isinstance(m, nn.Embedding), _embedding),
    (lambda m: isinstance(m, nn.PReLU), _prelu),
)


def _width_setter(module: nn.Module) -> Callable[[Any, torch.Tensor], None] | None:
    return next((setter for matches, setter in _WIDTHS if matches(module)), None)


def sets_widths_of(module: nn.Module) -> bool:
    """Whether :func:`fit_widths` can give ``module`` (a layer of a kind a cut narrows) the saved widths."""
    return _width_setter(module) is not None


def differing_layers(
    module: nn.Module, state_dict: Mapping[str, Any], prefix: str = ""
) -> dict[str, dict[str, torch.Size]]:
    """Qualified layer name -> {its parameter or buffer name: the saved shape} for the entries of
    ``state_dict`` whose shape differs from ``module``'s."""
    differing: dict[str, dict[str, torch.Size]] = {}
    for layer_name, layer in module.named_modules():
        for name, tensor in (*layer._parameters.items(), *layer._buffers.items()):
            key = f"{prefix}{layer_name}.{name}" if layer_name else f"{prefix}{name}"
            saved = state_dict.get(key)
            if tensor is None or nn.parameter.is_lazy(tensor) or not isinstance(saved, torch.Tensor):
                continue
            if saved.shape != tensor.shape:
                differing.setdefault(layer_name, {})[name] = saved.shape
    return differing


def fit_widths(
    module: nn.Module, state_dict: Mapping[str, Any], prefix: str = "", unreplayed: str | None = None
) -> None:
    """Give every layer of ``module`` whose entries in ``state_dict`` have other shapes tensors of those
    shapes (values left to the load that follows) and the widths its ``forward`` reads. ``unreplayed``: why
    the recorded channel removals could not be replayed (``None``: none were recorded), said in the error.

    Raises:
        RuntimeError: for a layer whose widths cannot be read from its shapes (a grouped convolution, a
            layer of another type), before anything is changed; the message names it and the way out.
    """
    differing = differing_layers(module, state_dict, prefix)
    layers = {name: module.get_submodule(name) for name in differing}
    unknown = [name for name, layer in layers.items() if _width_setter(layer) is None]
    for name, layer in layers.items():
        if any(len(shape) != _entry(layer, entry).dim() for entry, shape in differing[name].items()):
            unknown.append(name)
    if differing:
        # a layer that holds a width but no tensor (a LayerNorm without affine weights) cannot be read from
        # the state dict: one as wide as a width that was cut may be the one fed the cut channels
        cut_widths = {
            _entry(layers[name], entry).shape[0] for name, entries in differing.items() for entry in entries
        }
        unknown += [
            name
            for name, layer in module.named_modules()
            if isinstance(layer, nn.LayerNorm)
            and not layer.elementwise_affine
            and layer.normalized_shape[-1] in cut_widths
        ]
    if unknown:
        names = ", ".join(sorted({name or "(the root)" for name in unknown}))
        kind = type(module.get_submodule(unknown[0])).__name__
        if unreplayed is None:
            raise RuntimeError(
                "ScheduledPrune: the state dict has cut widths but no record of the channel removals (a "
                f"weights-only checkpoint), and the widths of {names} ({kind}) cannot be read from their shapes "
                f"alone. To load such a model, {FULL_CHECKPOINT}."
            )
        raise RuntimeError(
            "ScheduledPrune: the channel removals the checkpoint records cannot be replayed on this module "
            f"({unreplayed}), and the widths of {names} ({kind}) cannot be read from their shapes alone. To load "
            "such a model, save the cut module whole (`torch.save(model)`), or leave the layers called "
            "depending on the data out of the cuts (`exclude_pattern`) in the run that saves it."
        )
    for name, layer in layers.items():
        for entry, shape in differing[name].items():
            _resize(layer, entry, shape)
        weight = layer._parameters.get("weight")
        if weight is None:  # a norm without affine weights: its running statistics tell its width
            weight = layer._buffers["running_mean"]
        _width_setter(layer)(layer, weight)


def _entry(layer: nn.Module, name: str) -> torch.Tensor:
    """``layer``'s own parameter or buffer ``name``."""
    tensor = layer._parameters.get(name)
    return layer._buffers[name] if tensor is None else tensor


@torch.no_grad()
def _resize(layer: nn.Module, name: str, shape: torch.Size) -> None:
    """Give ``layer.<name>`` an uninitialised tensor of ``shape`` (same object for a parameter: whatever holds
    it stays valid)."""
    if name in layer._parameters:
        parameter = layer._parameters[name]
        dtype, layout = parameter.dtype, memory_format_of(parameter)
        drop_gradient_accumulator(parameter)
        parameter.data = torch.empty(shape, dtype=dtype, device=parameter.device, memory_format=layout)
        return
    buffer = layer._buffers[name]
    layer._buffers[name] = torch.empty(shape, dtype=buffer.dtype, device=buffer.device)
