"""Which of a module's own parameters and buffers its forward writes: running statistics, an EMA, a counter.

Plain torch. The activation cache (:mod:`lightning_pulse.core.activation_cache`) replays a frozen module's
output instead of running its forward, so a module whose training forward writes its own state cannot be
replayed: the state would stand still where a run without the cache moves it (InstanceNorm's running
statistics with ``track_running_stats=True``, an EMA buffer read in eval, fake-quant observers).
"""

from __future__ import annotations

import operator

import torch
from torch import nn

TensorDicts = list[dict[str, torch.Tensor | None]]


def tensor_dicts(module: nn.Module) -> TensorDicts:
    """The parameter dict, then the buffer dict, of ``module`` and of each of its submodules (in ``modules()``
    order): what its output depends on, and what its forward may write. Read in place, not copied."""
    return [d for sub in module.modules() for d in (sub._parameters, sub._buffers)]


def versions(tensors: list[torch.Tensor | None]) -> list[int]:
    """The version counter of each tensor (each in-place write bumps it); -1 for ``None`` and for an inference
    tensor, which keeps none (it is compared by identity alone)."""
    try:
        return [-1 if tensor is None else tensor._version for tensor in tensors]
    except RuntimeError:  # an inference tensor among them
        return [_version_or_none(tensor) for tensor in tensors]


def _version_or_none(tensor: torch.Tensor | None) -> int:
    try:
        return -1 if tensor is None else tensor._version
    except RuntimeError:
        return -1


def _comparable(tensor: torch.Tensor) -> bool:
    """Whether a buffer's values can be copied and compared (``torch.equal``): not a sparse or nested one
    (a graph layer's sparse adjacency), whose writes the identity and version counter still see."""
    return tensor.layout == torch.strided and not tensor.is_nested


def _same_values(before: torch.Tensor, now: torch.Tensor) -> bool:
    """Whether ``now`` holds the values of ``before``; NaN equals NaN (a buffer holding one is not written
    by being read)."""
    if before.shape != now.shape or before.dtype != now.dtype:
        return False
    if torch.equal(before, now):
        return True
    if not before.is_floating_point():
        return False
    return torch.equal(before.isnan(), now.isnan()) and torch.equal(
        before.nan_to_num(0.0), now.nan_to_num(0.0)
    )


class StateBeforeForward:
    """The tensors of a module's :func:`tensor_dicts` with their version counters before a forward, and, where
    asked, copies of its buffers' values: a write that bumps no counter is seen only by them (torch's fused
    fake-quant op updates its observer's statistics in place without bumping it; so does a write through
    ``.data``). Flat lists, compared by identity and counter in one pass, as the cache's own check of writes
    between forwards; names are made only for what changed.

    Args:
        dicts: the module's :func:`tensor_dicts`.
        with_values: copy its buffers too (one copy of each: the cache does so once per module, at its first
            recorded forward).
    """

    def __init__(self, dicts: TensorDicts, with_values: bool) -> None:
        self.keys = [tuple(d) for d in dicts]
        self.tensors = [tensor for d in dicts for tensor in d.values()]
        self.versions = versions(self.tensors)
        self.buffer_values: dict[tuple[int, str], torch.Tensor] | None = None
        if with_values:  # the buffer dicts are every second one
            self.buffer_values = {
                (position, key): tensor.detach().clone()
                for position, d in enumerate(dicts)
                if position % 2
                for key, tensor in d.items()
                if tensor is not None and _comparable(tensor)
            }

    def written(self, module: nn.Module, dicts: TensorDicts) -> list[str]:
        """The names of ``module``'s parameters and buffers (in ``dicts``, as given to the constructor) that
        were written, replaced, added or removed since."""
        tensors = [tensor for d in dicts for tensor in d.values()]
        same = (
            [tuple(d) for d in dicts] == self.keys
            and all(map(operator.is_, tensors, self.tensors))
            and versions(tensors) == self.versions
        )
        changed = [] if same else self._changed_entries(dicts)
        if self.buffer_values is not None:
            changed += [
                (position, key)
                for (position, key), copy in self.buffer_values.items()
                if (position, key) not in changed
                and (tensor := dicts[position].get(key)) is not None
                and not _same_values(copy, tensor)
            ]
        if not changed:
            return []
        # the dicts come in pairs per submodule, in modules() order: its name prefixes both (none for a
        # submodule the forward removed)
        prefixes = [f"{name}." if name else "" for name, _ in module.named_modules() for _ in (0, 1)]
        return [(prefixes[at] if at < len(prefixes) else "") + key for at, key in changed]

    def _changed_entries(self, dicts: TensorDicts) -> list[tuple[int, str]]:
        """``(dict position, key)`` of each tensor written, replaced, added or removed since."""
        before = iter(zip(self.tensors, self.versions))
        changed = []
        for position, (d, keys) in enumerate(zip(dicts, self.keys)):
            gone = {key: next(before) for key in keys}
            for key, tensor in d.items():
                was = gone.pop(key, None)
                if was is None or was[0] is not tensor or was[1] != _version_or_none(tensor):
                    changed.append((position, key))
            changed += [(position, key) for key in gone]
        return changed


def _in_fake_quant(module: nn.Module, tensor_name: str) -> bool:
    """Whether the tensor ``tensor_name`` of ``module`` belongs to a fake-quant module or an observer."""
    from torch.ao.quantization import FakeQuantizeBase
    from torch.ao.quantization.observer import ObserverBase

    parts = tensor_name.split(".")[:-1]
    for end in range(1, len(parts) + 1):
        try:
            owner = module.get_submodule(".".join(parts[:end]))
        except AttributeError:  # a tensor whose module the forward removed
            return False
        if isinstance(owner, (FakeQuantizeBase, ObserverBase)):
            return True
    return False


def writes_state_reason(module: nn.Module, written: list[str]) -> str:
    """Why ``module``, whose forward wrote its tensors ``written`` (:meth:`StateBeforeForward.written`),
    cannot be replayed by the activation cache."""
    quoted = [f"`{name}`" for name in written]
    if len(quoted) > 3:
        quoted = [*quoted[:3], f"{len(quoted) - 3} more"]
    shown = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"
    it, them = ("it", "it") if len(written) == 1 else ("they", "them")
    reason = (
        f"its forward writes its own {shown} in training mode (running statistics, as InstanceNorm's with "
        f"`track_running_stats=True`, an EMA, a counter), and a replay skips the forward, so {it} would "
        f"stand still where a run without the cache moves {them}"
    )
    if any(_in_fake_quant(module, name) for name in written):
        reason += (
            "; fake-quant observers write them, moving their scale at every training forward: to cache it, "
            "turn the observers off once they settled (`model.apply(torch.ao.quantization.disable_observer)`)"
        )
    return reason
