"""Which module's forward made each autograd node: a parameter read inside its own unit's forward is no tie.

Plain torch. GradientCache's first backward pins a unit whose parameter the forward reads by ops of different
kinds (an embedding read again as the output projection, ``F.linear(h, embed.weight)``): freezing it would
stop the output layer too. A layer that reads its own weight twice inside its forward (spectral norm's
``sigma = u . (W v)`` and ``W / sigma``, weight standardisation's ``(w - mean(w)) / std(w)``) ties nothing:
freezing its unit stops every read together. :class:`ForwardCalls` records, during one forward, the span of
autograd sequence numbers (which every node takes in turn, as the forward makes it) of each module's calls;
:meth:`ForwardCalls.own_reads` tells whether a node reading a unit's parameter lies inside its own forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_pulse.core.freeze_units import FreezeUnit

_PARAMETRIZATIONS = ".parametrizations."  # where torch.nn.utils.parametrize keeps a tensor's ``original``


class ForwardCalls:
    """The spans of autograd sequence numbers that each module's forward calls made, in the forwards run
    between :meth:`arm` and :meth:`close`.

    A node made inside a call has a sequence number between the two taken when the call began (before its
    forward pre-hooks) and ended (after its forward hooks): autograd numbers the nodes a thread makes in turn.
    Without a record (never armed, a module run through ``.forward``, a ``torch.jit.script``-ed one), no read
    counts as its own, so the reads are judged as before.
    """

    def __init__(self) -> None:
        self._spans: dict[int, list[tuple[int, int]]] = {}  # id(module) -> (first, last) of each call
        self._open: dict[int, list[int]] = {}  # id(module) -> the sequence numbers its open calls began at
        self._hooks: list[Any] = []
        self._model: nn.Module | None = None
        self._probe = torch.zeros((), requires_grad=True)

    def arm(self, model: nn.Module) -> None:
        """Record the calls of ``model``'s modules from now on (a record from before is dropped)."""
        self._spans, self._open = {}, {}
        if self._model is model and self._hooks:
            return
        self.close()
        self._model = model
        for module in model.modules():
            if isinstance(module, torch.jit.ScriptModule):  # takes no hooks: its reads count as outside
                continue
            # first of the pre-hooks: the older spectral_norm computes `weight` in one of them
            self._hooks.append(module.register_forward_pre_hook(self._began, prepend=True))
            self._hooks.append(module.register_forward_hook(self._ended, always_call=True))

    def close(self) -> None:
        """Remove the hooks; the record stays for :meth:`own_reads`."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._model = [], None

    def _number(self) -> int | None:
        """A fresh autograd sequence number: nodes this thread made before have smaller ones, later ones
        larger."""
        with torch.enable_grad():
            node = self._probe.view_as(self._probe).grad_fn
        return None if node is None else node._sequence_nr()  # no node under inference mode

    def _began(self, module: nn.Module, args: Any) -> None:
        if (number := self._number()) is not None:
            self._open.setdefault(id(module), []).append(number)

    def _ended(self, module: nn.Module, args: Any, output: Any) -> None:
        began = self._open.get(id(module))
        if began and (number := self._number()) is not None:
            self._spans.setdefault(id(module), []).append((began.pop(), number))

    def _inside(self, module: nn.Module, number: int) -> bool:
        return any(first < number < last for first, last in self._spans.get(id(module), ()))

    def own_reads(self, units: Sequence[FreezeUnit], root: nn.Module) -> Callable[[nn.Parameter, int], bool]:
        """A test of whether the node with sequence number ``number`` reading ``param`` (a parameter of one of
        ``units``, discovered in ``root``) was made inside its own unit's forward.

        Its own forward is a call of the outermost module holding it whose trainable parameters all belong to
        its unit and that the forward called (a unit's module; for a unit that is a lone parameter, the module
        holding it if that holds nothing else). A parametrized tensor's ``original`` is held by its
        parametrization, which runs wherever the layer's tensor is read; so its read must also lie inside a
        call of the layer (``X`` of ``X.parametrizations.weight``): a head reading ``embed.weight`` is not the
        embedding's own forward, even through the embedding's spectral norm.
        """
        modules = dict(root.named_modules())
        holders: dict[str, set[int]] = {}  # module name -> the units holding a trainable parameter under it
        for index, unit in enumerate(units):
            for name in unit.param_names:
                for prefix in _prefixes(name):
                    holders.setdefault(prefix, set()).add(index)
        scopes: dict[int, list[nn.Module]] = {}  # id(parameter) -> the modules each own read lies inside
        for index, unit in enumerate(units):
            for name, param in zip(unit.param_names, unit.params):
                own = [modules[p] for p in _prefixes(name) if holders.get(p) == {index} and p in modules]
                called = [module for module in own if id(module) in self._spans]
                if not called:
                    continue
                scope = [called[-1]]  # the outermost
                layer = name.rpartition(_PARAMETRIZATIONS)[0] if _PARAMETRIZATIONS in name else None
                if layer is not None and layer in modules and parametrize.is_parametrized(modules[layer]):
                    if modules[layer] not in own:
                        scope.append(modules[layer])
                scopes[id(param)] = scope

        def own_read(param: nn.Parameter, number: int) -> bool:
            scope = scopes.get(id(param))
            return scope is not None and all(self._inside(module, number) for module in scope)

        return own_read


def _prefixes(name: str) -> list[str]:
    """The names of the modules holding the parameter ``name``, innermost first: ``a.b.w`` -> ``a.b``, ``a``,
    ``""`` (the root)."""
    parts = name.split(".")[:-1]
    return [".".join(parts[:end]) for end in range(len(parts), -1, -1)]
