"""Custom autograd Functions that a frozen prefix could break, found in the first backward. Plain torch.

Freezing relies on autograd skipping what needs no gradient. A custom ``torch.autograd.Function`` (a Python
``forward``/``backward`` pair) can break that in two ways, both seen on held-out models:

* its backward hands gradients to parameters that are not its inputs (reached through a closure, as Hugging
Face
  Reformer's ``_ReversibleFunction`` reaches every encoder layer). Once a frozen prefix makes all its inputs
  grad-free, autograd never calls that backward, and those parameters silently stop training;
* its backward differentiates its parameter inputs itself (``torch.autograd.grad(out, [x] + params)``, a
RevNet
  block) and raises ``One of the differentiated Tensors does not require grad`` once some of them are frozen
  while it is still called.

:class:`FunctionScan` watches the fit's first backward: it finds the first kind from the parameters that get a
gradient inside a Function's backward without being leaves of the graph. The second kind cannot be told from a
healthy one without calling the user's backward once more, which is not safe (a backward may pop state kept on
``ctx``, unpack a checkpointed tensor once, recompute BatchNorm, draw random numbers or add into a buffer
itself): every Function that takes parameters of several units as inputs is treated as that kind.
:meth:`FunctionScan.groups` turns both into units that freeze only together: a prefix then leaves such a
Function either untouched or with no input needing a gradient (not called, and all it trains frozen with it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_pulse.core.freeze_units import _PARAMETER_OPS, FreezeUnit, _op_name


def is_custom_function(node: Any) -> bool:
    """Whether an autograd node is the backward of a Python ``torch.autograd.Function``."""
    return hasattr(node, "_forward_cls")


@dataclass
class CustomFunction:
    """A Python autograd Function node of the first graph and what feeds it.

    Attributes:
        name: the Function's class name.
        input_reach: for each input needing a gradient, the bit set of the units whose parameters it reaches.
        parameter_inputs: for each of those inputs, whether it is a parameter of a unit, or computed from
            parameters alone.
        parameters: ids of the parameters that are its inputs themselves.
        closure: ids of the parameters that got their gradient inside its backward without being its inputs.
    """

    name: str
    input_reach: list[int]
    parameter_inputs: list[bool]
    parameters: set[int] = field(default_factory=set)
    closure: set[int] = field(default_factory=set)

    @property
    def takes_parameters(self) -> bool:
        return any(self.parameter_inputs)


def _bits(value: int) -> list[int]:
    found = []
    while value:
        lowest = value & -value
        found.append(lowest.bit_length() - 1)
        value ^= lowest
    return found


class FunctionScan:
    """Watches one backward (the fit's first) for custom Functions a frozen prefix could break.

    Create it before the backward, with the ``loss`` and the ``units`` (in any order); call :meth:`finish`
    after it. The hooks it places live for that backward only.

    Args:
        units: the units whose parameters may freeze.
        loss: the loss about to be differentiated.
        named: the model's named parameters (``model.named_parameters()``).
    """

    def __init__(
        self, units: Sequence[FreezeUnit], loss: torch.Tensor, named: Mapping[str, nn.Parameter]
    ) -> None:
        self.units = list(units)
        self.leaves: set[int] = set()  # ids of the parameters the graph reaches as leaves
        self.functions: list[CustomFunction] = []
        self._names = {id(param): name for name, param in named.items()}
        self._params = [param for param in named.values() if param.requires_grad]
        self._unit_of = {id(param): index for index, unit in enumerate(self.units) for param in unit.params}
        self._active: list[int] = []  # the Functions whose backward runs now, innermost last
        self._handles: list[Any] = []
        self._nodes: list[Any] = []  # the custom Function nodes, in the order of :attr:`functions`
        if loss.grad_fn is not None:
            self._walk(loss.grad_fn)
        if any(id(param) not in self.leaves for param in self._params):  # trained inside a backward
            self._hook()

    def _walk(self, root: Any) -> None:
        reach: dict[Any, int] = {}
        parameter_only: set[Any] = set()
        nodes: list[Any] = []
        stack, entered = [(root, False)], set()
        while stack:  # depth first, children before their node, without recursion (graphs are deep)
            node, children_done = stack.pop()
            children = [child for child, _ in node.next_functions if child is not None]
            if children_done:
                bits = 0
                for child in children:
                    bits |= reach.get(child, 0)
                variable = getattr(node, "variable", None)  # an AccumulateGrad: the parameter itself
                if isinstance(variable, torch.Tensor):
                    self.leaves.add(id(variable))
                    parameter_only.add(node)
                    if id(variable) in self._unit_of:
                        bits |= 1 << self._unit_of[id(variable)]
                elif (
                    _op_name(node) in _PARAMETER_OPS
                    and children
                    and all(c in parameter_only for c in children)
                ):
                    parameter_only.add(node)
                reach[node] = bits
                nodes.append(node)
                continue
            if node in entered:
                continue
            entered.add(node)
            stack.append((node, True))
            stack.extend((child, False) for child in children if child not in entered)
        self._nodes = [node for node in nodes if is_custom_function(node)]
        for node in self._nodes:
            children = [child for child, _ in node.next_functions if child is not None]
            name = getattr(node._forward_cls, "__qualname__", type(node).__name__)
            reaches = [reach.get(child, 0) for child in children]
            parameters = [child in parameter_only and bool(bits) for child, bits in zip(children, reaches)]
            direct = {
                id(child.variable)
                for child in children
                if isinstance(getattr(child, "variable", None), torch.Tensor)
            }
            self.functions.append(CustomFunction(name, reaches, parameters, direct))

    def _hook(self) -> None:
        for index, node in enumerate(self._nodes):
            self._handles.append(node.register_prehook(self._entering(index)))
            self._handles.append(node.register_hook(self._leaving))
        for param in self._params:
            if id(param) not in self.leaves:  # reached some other way: inside a Function's backward
                self._handles.append(param.register_post_accumulate_grad_hook(self._accumulated))

    def _entering(self, index: int) -> Any:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            self._active.append(index)  # only noted: the user's backward is never called here

        return hook

    def _leaving(self, grad_inputs: Any, grad_outputs: Any) -> None:
        if self._active:
            self._active.pop()

    def _accumulated(self, param: torch.Tensor) -> None:
        if self._active:
            self.functions[self._active[-1]].closure.add(id(param))

    def finish(self) -> None:
        """Remove the hooks (also when the backward never came)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._active, self._nodes = [], [], []  # the graph is not kept alive

    def groups(self, units: Sequence[FreezeUnit]) -> list[tuple[int, int, str]]:
        """For ``units`` in forward order, the spans ``(first, last, note)`` of positions that must freeze
        together because of a Function: from the first unit whose freezing changes what the Function gets to
        the last one it needs. A prefix covering ``first`` but not ``last`` would leave it called with a
        frozen parameter it may differentiate, or not called while parameters it trains still train."""
        position = {id(unit): index for index, unit in enumerate(units)}
        at = [position[id(unit)] for unit in self.units]  # this scan's unit index -> forward position
        spans = []
        for function in self.functions:
            closure_units = {at[self._unit_of[key]] for key in function.closure if key in self._unit_of}
            if not function.takes_parameters and not closure_units:
                continue
            # an input stops needing a gradient once the prefix covers the last unit it reaches
            lasts = [
                (max(at[bit] for bit in _bits(reach)), is_parameter)
                for reach, is_parameter in zip(function.input_reach, function.parameter_inputs)
                if reach
            ]
            if closure_units:  # not called once no input needs a gradient: they freeze with its inputs
                needed = {last for last, _ in lasts} | closure_units
            else:  # called with some of its parameters frozen: they freeze together, and with any input
                # computed after the first of them
                needed = {last for last, is_parameter in lasts if is_parameter}
                needed |= {last for last, _ in lasts if needed and last > min(needed)}
            if len(needed) < 2:
                continue
            first, last = min(needed), max(needed)
            spans.append((first, last, self._note(function, units, first, last)))
        return spans

    def _note(self, function: CustomFunction, units: Sequence[FreezeUnit], first: int, last: int) -> str:
        span = f"{units[first].name} through {units[last].name}"
        names = sorted(self._names.get(key, "?") for key in function.closure or function.parameters)
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        where = f"the custom autograd Function {function.name} in {_common_module(names)}"
        if not function.closure:
            return (
                f"{where} takes parameters of several units as inputs ({shown}): a backward that "
                "differentiates them all (a RevNet block's `torch.autograd.grad(out, [x] + params)`) fails "
                "once a frozen prefix ends among them, and only a second call of the user's backward could "
                f"tell. So {span} freeze only together, or not at all; to let them freeze separately, apply "
                "one Function per layer"
            )
        return (
            f"{where} gives gradients in its backward to parameters that are not its inputs ({shown}), and "
            "once a frozen prefix makes its inputs grad-free autograd never calls that backward, so they "
            f"would stop training. So {span} freeze only together, or not at all; to let them freeze "
            "separately, pass those parameters to it as inputs"
        )


DDP_INNER_BACKWARD = (
    "A model whose custom autograd Function trains layers that are not its inputs, by running a backward "
    "through them inside its own backward (Hugging Face Reformer's reversible layers, a RevNet block that "
    "reaches its layers that way), fails under `find_unused_parameters=True` in DDP itself, with or without "
    "GradientCache: DDP marks those parameters unused after the forward, then their gradients arrive "
    "('Expected to mark a variable ready only once'). So GradientCache cannot freeze such a model under DDP: "
    "train it without GradientCache (DDP with `static_graph=True` trains it), or with GradientCache on one "
    "process. (Gradient checkpointing with `use_reentrant=True` fails the same way: use "
    "`use_reentrant=False`.)"
)


def ddp_inner_backward_note(exception: BaseException) -> str | None:
    """The note for DDP's error at a backward under ``find_unused_parameters=True`` (which GradientCache asks
    for) when a parameter got its gradient after DDP had marked it unused; ``None`` for any other error, and
    for GradientCache's own messages (its refusal quotes DDP's error)."""
    text = str(exception)
    if "mark a variable ready only once" not in text or "GradientCache:" in text:
        return None
    return (
        "GradientCache: DDP failed under `find_unused_parameters=True`, which GradientCache asks for; that "
        f"advice does not hold for every model. {DDP_INNER_BACKWARD}."
    )


def add_ddp_inner_backward_note(exception: BaseException, warn: Callable[[str], Any]) -> None:
    """Add :func:`ddp_inner_backward_note` to ``exception`` where it applies, as a note (Python 3.11 on;
    before that, ``warn`` says it)."""
    if (note := ddp_inner_backward_note(exception)) is not None:
        getattr(exception, "add_note", warn)(note)


def _common_module(names: Sequence[str]) -> str:
    """The deepest module holding every parameter of ``names`` (``"the model"`` for the root)."""
    parts = [name.split(".")[:-1] for name in names]
    common: list[str] = []
    for pieces in zip(*parts):
        if len(set(pieces)) > 1:
            break
        common.append(pieces[0])
    return ".".join(common) or "the model"
