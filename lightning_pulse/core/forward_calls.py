"""Which module's call made each autograd node: a parameter read only inside calls of its own unit's forward,
each call reading it by every kind of op it is read by, is no tie.

Plain torch. GradientCache's first backward pins a unit whose parameter the forward reads by ops of different
kinds (an embedding read again as the output projection, ``F.linear(h, embed.weight)``): freezing it would
stop the output layer too. A layer that reads its own weight twice inside its forward (spectral norm's
``sigma = u . (W v)`` and ``W / sigma``, weight standardisation's ``(w - mean(w)) / std(w)``) ties nothing:
freezing its unit stops every read together. :class:`ForwardCalls` records, during one forward, the span of
autograd sequence numbers (which every node takes in turn, as the forward makes it) of each module's calls;
:meth:`ForwardCalls.own_reads` tells whether a unit's parameter's reads lie so. The sequence number is private
torch API (``Node._sequence_nr()``), read in one place (:func:`sequence_number`): where it is missing, every
read counts as outside, so a weight read by ops of different kinds is pinned, as before the record.

The same record notes which of those modules ``training_step`` differentiated before the fit's backward: a
call inside a ``torch.func`` transform (``vmap(jacrev(net))``, ``vmap(grad(...))``; its reads are its own,
lowered to other ops, as ``Add`` and ``Mv`` for a per-sample ``Linear``), or an output reached by a
``torch.autograd.grad(..., create_graph=True)`` (a PINN's derivatives, an input-gradient penalty). The
backward of such a derivative applies each layer's weight again after the later layers: GradientCache's
notes name it (:attr:`ForwardCalls.differentiated`) instead of a loop or a tie the model does not have.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_pulse.core.freeze_units import FreezeUnit
from lightning_pulse.core.func_transforms import differentiating, transform_active, unwrapped

#: how ``training_step`` differentiated a layer before the fit's backward (:attr:`ForwardCalls.differentiated`)
TRANSFORM = "a torch.func transform (jacrev, grad, vjp, jvp) in training_step"
CREATE_GRAPH = "torch.autograd.grad(..., create_graph=True) in training_step"

_PARAMETRIZATIONS = ".parametrizations."  # where torch.nn.utils.parametrize keeps a tensor's ``original``
_SEQUENCE_NR = "_sequence_nr"  # the private torch method (2.x) numbering autograd nodes, read only here


def sequence_number(node: Any) -> int | None:
    """The autograd sequence number of ``node`` (``Node._sequence_nr()``, private torch API), or ``None``
    where this torch gives none (renamed, or failing): the callers then judge a weight's reads as before the
    record of calls, as a tie where they are of different kinds."""
    try:
        number = getattr(node, _SEQUENCE_NR)()
    except Exception:  # any failure of a private method means the same: no number to compare
        return None
    return number if isinstance(number, int) else None


class ForwardCalls:
    """The spans of autograd sequence numbers that each module's forward calls made, in the forwards run
    between :meth:`arm` and :meth:`close`.

    A node made inside a call has a sequence number between the two taken when the call began (before its
    forward pre-hooks) and ended (after its forward hooks): autograd numbers the nodes a thread makes in turn.
    Without a record (never armed, a module run through ``.forward``, a ``torch.jit.script``-ed one, no
    sequence numbers in this torch), no read counts as its own, so the reads are judged as before. Only the
    modules :meth:`own_reads` can use are hooked: those holding a unit's parameter, outside any compiled part
    (a hook inside one is traced by dynamo, which breaks the graph at the hook's autograd node: a frozen
    teacher under ``torch.compile`` ran as 3 graphs with 10 breaks, for the rest of the fit, instead of 1).
    """

    def __init__(self) -> None:
        self._spans: dict[int, list[tuple[int, int]]] = {}  # id(module) -> (first, last) of each call
        self._open: dict[int, list[int]] = {}  # id(module) -> the sequence numbers its open calls began at
        self._transformed_spans: set[tuple[int, int]] = set()  # the calls made inside a torch.func transform
        #: id(module) -> how ``training_step`` differentiated it before the fit's backward (the first seen):
        #: :data:`TRANSFORM` or :data:`CREATE_GRAPH`
        self.differentiated: dict[int, str] = {}
        self._hooks: list[Any] = []
        self._output_hooks: list[Any] = []  # on the outputs of the calls, until the fit's backward
        self._model: nn.Module | None = None
        self._watched: list[int] = []  # id() of each module hooked
        self._probe = torch.zeros((), requires_grad=True)

    def arm(self, model: nn.Module, units: Sequence[FreezeUnit]) -> None:
        """Record the calls of those of ``model``'s modules that hold a parameter of ``units`` from now on (a
        record from before is dropped)."""
        self._spans, self._open, self._transformed_spans, self.differentiated = {}, {}, set(), {}
        holding = {prefix for unit in units for name in unit.param_names for prefix in _prefixes(name)}
        watched = list({id(m): m for name, m in _uncompiled_modules(model) if name in holding}.values())
        key = [id(module) for module in watched]
        if self._model is model and self._watched == key and self._hooks:
            return
        self.close()
        self._model, self._watched = model, key
        for module in watched:
            # first of the pre-hooks: the older spectral_norm computes `weight` in one of them
            self._hooks.append(module.register_forward_pre_hook(self._began, prepend=True))
            self._hooks.append(module.register_forward_hook(self._ended, always_call=True))

    def close(self) -> None:
        """Remove the hooks; the record stays for :meth:`own_reads`."""
        for hook in (*self._hooks, *self._output_hooks):
            hook.remove()
        self._hooks, self._output_hooks, self._model, self._watched = [], [], None, []

    def _number(self) -> int | None:
        """A fresh autograd sequence number: nodes this thread made before have smaller ones, later ones
        larger."""
        with torch.enable_grad():
            # inside a torch.func transform the view is wrapped; ordinary autograd's node is under it
            node = unwrapped(self._probe.view_as(self._probe)).grad_fn
        return None if node is None else sequence_number(node)  # no node under inference mode

    def _began(self, module: nn.Module, args: Any) -> None:
        if (number := self._number()) is not None:
            self._open.setdefault(id(module), []).append(number)

    def _ended(self, module: nn.Module, args: Any, output: Any) -> None:
        began, inside = self._open.get(id(module)), transform_active()
        if began and (number := self._number()) is not None:
            span = (began.pop(), number)
            self._spans.setdefault(id(module), []).append(span)
            if inside:
                self._transformed_spans.add(span)
        if inside:
            if differentiating():
                self.differentiated.setdefault(id(module), TRANSFORM)
        elif isinstance(output, torch.Tensor) and output.requires_grad:
            self._output_hooks.append(output.register_hook(functools.partial(self._reached, id(module))))

    def _reached(self, key: int, gradient: torch.Tensor) -> None:
        # a backward while the record is on runs inside training_step; with a graph of its own: create_graph
        if self._hooks and torch.is_grad_enabled():
            self.differentiated.setdefault(key, CREATE_GRAPH)

    def differentiated_units(self, units: Sequence[FreezeUnit], root: nn.Module) -> dict[str, str]:
        """The names of ``units`` with a layer (a module holding one of their parameters itself, not
        ``root``) that ``training_step`` differentiated before the fit's backward, each with how
        (:attr:`differentiated`)."""
        how_of = {name: self.differentiated.get(id(module)) for name, module in root.named_modules() if name}
        found: dict[str, str] = {}
        for unit in units:
            for name in unit.param_names:
                if (how := how_of.get(name.rpartition(".")[0])) is not None:
                    found.setdefault(unit.name, how)
        return found

    def _call_holding(self, module: nn.Module, number: int) -> tuple[int, int] | None:
        """The innermost call of ``module`` that made the node numbered ``number``, else ``None``."""
        spans = [span for span in self._spans.get(id(module), ()) if span[0] < number < span[1]]
        return min(spans, key=lambda span: span[1] - span[0]) if spans else None

    def own_reads(
        self, units: Sequence[FreezeUnit], root: nn.Module
    ) -> Callable[[nn.Parameter, Mapping[str, Sequence[int | None]]], bool]:
        """A test of whether the reads of ``param`` (a parameter of one of ``units``, discovered in ``root``),
        given as the sequence numbers of the nodes of each kind of op reading it, were all made inside calls
        of its own unit's forward, each of those calls reading it by every one of the kinds. Spectral norm and
        weight standardisation read their weight by ops of different kinds in each call of the layer (also in
        a layer applied several times); a tied embedding doing the lookup in one call and the output
        projection in another (``embed(x)``, then ``embed(h, decode=True)``) reads it by one kind a call: a
        tie, which freezing the unit would stop on both sides.

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

        def own_read(param: nn.Parameter, reads: Mapping[str, Sequence[int | None]]) -> bool:
            scope = scopes.get(id(param))
            if scope is None:
                return False
            for module in scope:
                kinds_by_call: dict[tuple[int, int], set[str]] = {}
                for kind, numbers in reads.items():
                    for number in numbers:
                        call = None if number is None else self._call_holding(module, number)
                        if call is None:  # outside its calls, or unnumbered (sequence_number)
                            return False
                        if call not in self._transformed_spans:  # a transform lowers the ops: Add for Addmm
                            kinds_by_call.setdefault(call, set()).add(kind)
                every = set().union(*kinds_by_call.values())
                if any(kinds != every for kinds in kinds_by_call.values()):
                    return False  # one call reads it by one kind, another by another: a tie
            return True

        return own_read

    def enclosing_reader(
        self, units: Sequence[FreezeUnit], root: nn.Module
    ) -> Callable[[nn.Parameter, Mapping[str, Sequence[int | None]]], str | None]:
        """A test naming, for a parameter of ``units`` whose reads :meth:`own_reads` did not find inside its
        own unit's forward, the innermost module above its own (not ``root``) inside whose calls every read
        was made: a layer whose forward reads its child's parameter (a user's fused Conv-BN folding
        ``bn.weight`` into its weight), split into units by the automatic split. ``None`` when there is none
        (the parameter is read by another layer: a tie without a second name), or when that module holds
        every unit (the whole model's forward doing a tied output projection: a tie too)."""
        modules = dict(root.named_modules())
        names = {id(param): name for unit in units for name, param in zip(unit.param_names, unit.params)}
        everything = [name for unit in units for name in unit.param_names]

        def reader(param: nn.Parameter, reads: Mapping[str, Sequence[int | None]]) -> str | None:
            name = names.get(id(param))
            numbers = [number for found in reads.values() for number in found]
            if name is None or not numbers or None in numbers:
                return None
            for prefix in _prefixes(name)[1:-1]:  # above the parameter's own module, below the root
                module = modules.get(prefix)
                if module is None or all(held.startswith(prefix + ".") for held in everything):
                    continue
                if all(self._call_holding(module, n) is not None for n in numbers):
                    return prefix
            return None

        return reader


def _prefixes(name: str) -> list[str]:
    """The names of the modules holding the parameter ``name``, innermost first: ``a.b.w`` -> ``a.b``, ``a``,
    ``""`` (the root)."""
    parts = name.split(".")[:-1]
    return [".".join(parts[:end]) for end in range(len(parts), -1, -1)]


def _uncompiled_modules(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` for ``model`` and its submodules, leaving out every part run under
    ``torch.compile`` (an ``OptimizedModule`` wrapper, or a module compiled in place with ``.compile()``,
    which keeps the private ``_compiled_call_impl``) or ``torch.jit.script`` (which takes no hooks), with all
    it holds."""
    from torch._dynamo.eval_frame import OptimizedModule

    compiled_in_place = model.__dict__.get("_compiled_call_impl") is not None
    if compiled_in_place or isinstance(model, (OptimizedModule, torch.jit.ScriptModule)):
        return
    yield prefix, model
    for name, child in model.named_children():
        yield from _uncompiled_modules(child, f"{prefix}.{name}" if prefix else name)
