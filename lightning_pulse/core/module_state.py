"""State a module carries between calls outside its parameters and buffers, e.g. an RNN's hidden state.

Such state is what a stateful model relies on across batches (truncated BPTT keeps ``self.state``), and what
an evaluation run in the middle of training must give back untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

_MODULE_SLOTS = ("_parameters", "_buffers", "_modules")


def is_tensor_state(value: Any) -> bool:
    """A tensor, or a non-empty tuple or list of them (nested), as an LSTM's ``(h, c)``."""
    if isinstance(value, torch.Tensor):
        return not isinstance(value, nn.Parameter)
    if isinstance(value, (tuple, list)) and value:
        return all(is_tensor_state(item) for item in value)
    return False


def carried_tensor_state(module: nn.Module) -> dict[str, Any]:
    """``{"sub.module.attr": value}`` for every plain attribute of ``module`` or a submodule holding tensor
    state (not a parameter, not a buffer)."""
    found: dict[str, Any] = {}
    for prefix, submodule in module.named_modules():
        for name, value in vars(submodule).items():
            if name not in _MODULE_SLOTS and is_tensor_state(value):
                found[f"{prefix}.{name}" if prefix else name] = value
    return found


@contextmanager
def kept_carried_state(module: nn.Module) -> Iterator[None]:
    """Give back, on exit, every plain attribute of ``module`` and its submodules that held tensor state or
    ``None`` on entry, and drop tensor state that appeared inside.

    References are restored, not values: this undoes code that rebinds ``self.state = ...`` (the usual way a
    stateful module updates it), not in-place writes into the same tensor.
    """
    saved: dict[tuple[int, str], tuple[nn.Module, Any]] = {}
    for submodule in module.modules():
        for name, value in vars(submodule).items():
            if name not in _MODULE_SLOTS and (value is None or is_tensor_state(value)):
                saved[(id(submodule), name)] = (submodule, value)
    try:
        yield
    finally:
        for submodule in module.modules():
            for name, value in list(vars(submodule).items()):
                if name in _MODULE_SLOTS:
                    continue
                entry = saved.get((id(submodule), name))
                if entry is not None:
                    # only a slot that held or now holds tensor state: other attributes are not ours to undo
                    rebound = value is not entry[1] and (entry[1] is not None or is_tensor_state(value))
                    if rebound:
                        submodule.__dict__[name] = entry[1]
                elif is_tensor_state(value):
                    del submodule.__dict__[name]
